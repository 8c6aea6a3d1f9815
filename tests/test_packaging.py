"""Packaging: the import root, `import operator` staying the standard library's everywhere, the
dependency rules between parts, and the CLI front door."""

from __future__ import annotations

import ast
import operator
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
CHECK = (
    "import operator, sys; assert hasattr(operator, 'itemgetter'), operator; "
    "import kvharbor.operator, kvharbor.engine, kvharbor.common; print(operator.__file__)"
)


def test_top_level_folders_are_the_parts():
    for folder in ("operator", "gateway", "engine", "kvcache_service", "charts", "loadtest", "tests", "common"):
        assert (REPO / folder).is_dir(), folder
    assert not (REPO / "operator" / "__init__.py").exists(), "operator/__init__.py would shadow the stdlib"


def test_operator_is_the_stdlib_module_in_this_process():
    assert Path(operator.__file__).resolve().parent == STDLIB


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("cwd", [REPO, REPO / "operator"])
def test_operator_is_the_stdlib_module_from_the_repository_root(cwd):
    # `python -m ...` puts the working directory first on sys.path, as `python -m pytest` does.
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).resolve().parent == STDLIB


PARTS = ("common", "engine", "gateway", "kvcache_service", "kv_bridge", "launch", "operator")


@pytest.mark.slow  # fresh interpreters
def test_operator_is_the_stdlib_module_from_a_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    # Built from a copy: setuptools reuses the repository's build/ folder, whose stale files once
    # hid a sub-package missing from pyproject's list.
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    for part in PARTS:
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.so", "README.md"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("kvharbor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.startswith("operator/") for n in names)
    assert "kvharbor/engine/llm.py" in names and "kvharbor/common/block_hash.py" in names
    from kvharbor.engine.cpu.cpu_kernels import HEADERS, SOURCES

    csrc = {f"kvharbor/engine/cpu/csrc/{p.name}" for p in (*SOURCES, *HEADERS)}  # compiled where the engine runs
    assert "kvharbor/engine/cpu/csrc/packed_int.c" in csrc and csrc <= set(names)
    assert "kvharbor/engine/kernels/decode.py" in names
    for module in (REPO / "operator").rglob("*.py"):  # operator code ships under kvharbor/operator/
        assert f"kvharbor/operator/{module.relative_to(REPO / 'operator').as_posix()}" in names
    # Every module of every part ships: a sub-package missing from pyproject's list (as
    # engine/structured/ once was) works in the editable install and fails only once installed.
    for part in PARTS:
        for module in (REPO / part).rglob("*.py"):
            assert f"kvharbor/{part}/{module.relative_to(REPO / part).as_posix()}" in names, module
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    # -S: no site-packages, so neither the editable install nor the repository can answer.
    code = (
        "import operator, kvharbor.common.block_hash as b; "
        "assert hasattr(operator, 'itemgetter'); print(operator.__file__, b.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=target,
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    stdlib_file, hash_file = out.stdout.split()
    assert Path(stdlib_file).resolve().parent == STDLIB
    assert Path(hash_file).resolve().is_relative_to(target.resolve())


def _imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def test_dependency_rules():
    parts = ("kvharbor.engine", "kvharbor.gateway", "kvharbor.kvcache_service", "kvharbor.operator")
    assert not {m for m in _imports(REPO / "common") if m.startswith(parts)}
    for control_plane in ("gateway", "kvcache_service", "operator"):
        bad = {m for m in _imports(REPO / control_plane) if m.startswith(("kvharbor.engine", "torch", "triton"))}
        assert not bad, f"{control_plane} imports {bad}"
    for part in ("engine", "gateway", "kvcache_service", "operator"):
        assert not {
            m
            for m in _imports(REPO / part)
            if m.startswith(("kvharbor.gateway", "kvharbor.operator")) and not m.startswith(f"kvharbor.{part}")
        }


@pytest.mark.slow  # fresh interpreters
def test_shared_code_imports_without_torch():
    code = (
        "import sys, kvharbor.common.block_hash, kvharbor.common.kv_events, kvharbor.common.config, "
        "kvharbor.launch.cli, kvharbor.common.model_files, kvharbor.gateway.app, kvharbor.gateway.service, "
        "kvharbor.kvcache_service.app, kvharbor.kvcache_service.service, kvharbor.operator.handlers, "
        "kvharbor.operator.service; assert 'torch' not in sys.modules, "
        "'a control-plane part loaded torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # The API server of `kvharbor serve` only talks to its engine core process: it stays slim too.
    server = (
        "import sys, kvharbor.engine, kvharbor.engine.serve.server, kvharbor.engine.serve.api_server, "
        "kvharbor.engine.serve.core_client; assert 'torch' not in sys.modules, 'the engine API server loaded torch'"
    )
    subprocess.run([sys.executable, "-c", server], check=True)


@pytest.mark.slow  # fresh interpreters
def test_importing_the_engine_makes_openmp_wait_passively():
    # Spinning OpenMP workers slowed CPU decoding ~10x on a busy 2-core machine (HF SmolLM2 at
    # torch's default 2 threads: 1.6 tok/s instead of ~14).
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, kvharbor.engine; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"


@pytest.mark.slow  # fresh interpreters
def test_an_engine_loaded_after_torch_without_a_policy_says_how_to_fix_it():
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import logging, sys; logging.basicConfig(); {first}\n"
            "from kvharbor.engine.model.device import set_cpu_threads\n"
            "import torch; cpu = torch.device('cpu'); set_cpu_threads(cpu, 1); set_cpu_threads(cpu, 1)")  # fmt: skip
    late = subprocess.run([sys.executable, "-c", code.format(first="import torch")], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert late.stderr.count("OMP_WAIT_POLICY=PASSIVE") == 1  # once per process
    early = subprocess.run([sys.executable, "-c", code.format(first="import kvharbor.engine")], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "OMP_WAIT_POLICY" not in early.stderr
