"""engine/'s layers (issue 49): no import runs back up. Each engine module belongs to one layer;
a module imports its own layer and those below, never one above, read from the package's source
with `ast` (imports under `if TYPE_CHECKING:` are for type checkers only, and do not count). A
module in no layer fails too: a new module is placed on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"

# Bottom to top. A root module by its name, a subpackage by its folder.
LAYERS: list[tuple[str, set[str]]] = [
    ("contracts and basics", {"config", "sampling_params", "request", "core_io", "outputs", "quantize", "pooling",
                              "decode_fit", "link_frames", "detokenizer", "counter_board", "omp_policy"}),
    ("kernels", {"cpu", "kernels"}),
    ("the KV cache", {"kv"}),
    ("the model", {"model", "lora"}),
    ("one step", {"sampler", "rejection", "scheduler", "runner", "output_processor", "engine_stats", "structured"}),
    ("speculation", {"spec"}),
    ("the core", {"core_parts", "core", "llm_engine", "llm", "cli", "__init__"}),
    ("the server", {"serve"}),
]  # fmt: skip
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """`kvharbor.engine.kv.block_pool` -> "kv"; `kvharbor.engine.model.decoder` -> "model"."""
    parts = module.split(".")[2:]
    return parts[0] if parts else "__init__"


def module_of(path: Path) -> str:
    rel = path.relative_to(ENGINE.parent).with_suffix("")
    parts = ["kvharbor", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every kvharbor.engine import that runs (not under TYPE_CHECKING)."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("kvharbor.engine"):
                for alias in child.names:  # `from kvharbor.engine import cpu` imports the module engine.cpu
                    target = f"{child.module}.{alias.name}"
                    out.append((child.lineno, target if _is_module(target) else child.module))
            elif isinstance(child, ast.Import):
                out.extend((child.lineno, a.name) for a in child.names if a.name.startswith("kvharbor.engine"))
            visit(child)

    visit(tree)
    return out


def _is_module(name: str) -> bool:
    path = ENGINE.parent.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_engine_module_has_a_layer():
    units = {unit_of(module_of(p)) for p in ENGINE.rglob("*.py")}
    assert units - set(LAYER_OF) == set(), "place each new engine module in a layer of LAYERS"


def test_no_import_runs_back_up():
    upward = []
    for path in sorted(ENGINE.rglob("*.py")):
        module = module_of(path)
        here = LAYER_OF[unit_of(module)]
        for line, target in runtime_imports(ast.parse(path.read_text()), module):
            there = LAYER_OF.get(unit_of(target))
            if there is not None and there > here:
                upward.append(f"{path.relative_to(ENGINE.parent)}:{line} ({LAYERS[here][0]}) imports {target} "
                              f"({LAYERS[there][0]})")  # fmt: skip
    assert upward == [], "\n".join(upward)


def test_the_check_sees_an_upward_import():
    """The walk itself: a kv/ module importing the server is caught, a type-only one is not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvharbor.engine.core import EngineCore\n"
              "def f():\n    from kvharbor.engine.serve import core_client\n")  # fmt: skip
    found = runtime_imports(ast.parse(source), "kvharbor.engine.kv.x")
    assert [unit_of(t) for _, t in found] == ["serve"]


def test_every_part_core_parts_builds_is_a_field_engine_core_declares():
    """Issue 49: the core's parts are visible in core.py: each attribute engine/core_parts.py
    builds is declared on EngineCore (annotated) and assigned there by name."""
    parts_tree = ast.parse((ENGINE / "core_parts.py").read_text())
    built = set()
    for node in ast.walk(parts_tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    built.add(t.attr)
    core_tree = ast.parse((ENGINE / "core.py").read_text())
    (core,) = [n for n in core_tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineCore"]
    declared = {n.target.id for n in core.body if isinstance(n, ast.AnnAssign)}
    def from_parts(n: ast.AST) -> bool:
        value = getattr(n, "value", None)
        assigned = isinstance(n, ast.Assign) and isinstance(value, ast.Attribute)
        return assigned and getattr(value.value, "id", "") == "parts"

    taken = {n.targets[0].attr for n in ast.walk(core) if from_parts(n)}
    assert built == declared == taken, (built ^ declared, built ^ taken)
