"""Tests put benchmarks/ and loadtest/ on sys.path to import their scripts, and the scripts import
each other by bare name. A script named like a module some library looks for then stands in for
it on that xdist worker: benchmarks/kernels.py once did, transformers took it for HF's `kernels`
package, and every later transformers import there failed (172 errors, depending on which files
a worker ran first). So no script may take such a name."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT_FOLDERS = ("benchmarks", "loadtest")


def probed_by_transformers() -> set[str]:
    """The optional packages transformers asks for by name (`_is_package_available("...")`)."""
    spec = importlib.util.find_spec("transformers.utils.import_utils")
    text = Path(spec.origin).read_text()
    return set(re.findall(r"_is_package_available\(\s*\"([\w.]+)\"", text))


def taken_names() -> dict[str, str]:
    taken = {name: "the standard library" for name in sys.stdlib_module_names}
    for name, dists in importlib.metadata.packages_distributions().items():
        taken.setdefault(name, f"the installed {', '.join(sorted(set(dists)))}")
    for name in probed_by_transformers():
        taken.setdefault(name.split(".")[0], "a package transformers probes for")
    return taken


def test_the_probe_list_is_read():
    assert {"torch", "kernels", "peft"} <= probed_by_transformers()  # the regex still matches the source


def test_no_script_shadows_a_module_a_library_may_import():
    taken = taken_names()
    clashes = [
        f"{folder}/{path.name} shadows {taken[path.stem]}: rename it"
        for folder in SCRIPT_FOLDERS
        for path in sorted((ROOT / folder).glob("*.py"))
        if path.stem in taken and path.stem != "__init__"
    ]
    assert not clashes, "\n".join(clashes)
