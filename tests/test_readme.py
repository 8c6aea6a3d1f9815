"""The README is the front door: what it tells a user to run exists as written. Make targets are
in the Makefile, `kvharbor` sub-commands and their flags are in the CLI, and the files it points
at are in the repository. No process starts here: the commands' own tests run them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvharbor.launch.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_LINES = 220  # issue 23: a front door, not a run log (dated figures live in benchmarks/README.md)


def _code() -> str:
    """Every command the README shows: its fenced blocks and its inline code."""
    fenced = re.findall(r"```(?:sh|python)?\n(.*?)```", README, re.S)
    inline = re.findall(r"`([^`\n]+)`", README)
    return "\n".join(fenced + inline)


def test_the_readme_is_short_enough_to_read_first():
    assert len(README.splitlines()) < MAX_LINES


def test_every_make_target_it_names_exists():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][a-z-]*)", _code()))
    assert {"up", "test"} <= named  # the two commands
    assert named <= targets, f"the README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_every_kvharbor_command_it_names_exists():
    named = set(re.findall(r"\bkvharbor ([a-z][a-z-]*)", _code()))
    assert {"up", "serve", "gateway", "kvcache"} <= named
    assert named <= set(COMMANDS), f"not kvharbor sub-commands: {sorted(named - set(COMMANDS))}"


CONFIGS = {  # the config class each command parses its flags into
    "serve": ("kvharbor.engine.config", "ServeConfig"),
    "kvcache": ("kvharbor.kvcache_service.config", "KVCacheServiceConfig"),
    "gateway": ("kvharbor.gateway.config", "GatewayConfig"),
    "up": ("kvharbor.launch.up", "UpConfig"),
}
# --help and --version print and exit: tests/test_cli.py runs them for every command.
COMMAND_LINE = r"kvharbor (serve|kvcache|up|gateway)((?: --?[\w-]+(?: [^\s&`-][^\s&`]*)?)*)"
LINES = sorted((n, a) for n, a in set(re.findall(COMMAND_LINE, _code())) if "--help" not in a and "--version" not in a)


@pytest.mark.parametrize("line", LINES, ids=[f"{n}{a}" for n, a in LINES])
def test_each_command_line_it_shows_parses(line, monkeypatch):
    """Its flags and values load as the command would load them (nothing starts)."""
    import importlib
    import shlex

    from kvharbor.common.config import config_from_argv

    for var in [v for v in __import__("os").environ if v.startswith("KVHARBOR_")]:
        monkeypatch.delenv(var)
    name, args = line
    module, cls = CONFIGS[name]
    config_from_argv(getattr(importlib.import_module(module), cls), shlex.split(args), f"kvharbor {name}", "")


def test_every_file_it_points_at_exists():
    paths = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]*)`", README)) | set(re.findall(r"\]\(([\w./-]+)\)", README))
    paths |= {p for p in re.findall(r"`([\w/.-]+\.(?:py|md|yaml|c|png))`", README) if "/" in p}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"the README points at files that are not there: {missing}"
