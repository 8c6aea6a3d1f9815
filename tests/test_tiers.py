"""The two test tiers stay honest: the process guard (tests/process_guard.py) fails a test that
starts a process without `@pytest.mark.slow`, however it starts it, and lets a marked one run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

INNER = '''
import asyncio
import multiprocessing
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc
    proc.kill()
    proc.wait()


def test_bare_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_bare_asyncio_subprocess():
    async def main():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await proc.wait()

    asyncio.run(main())


def test_bare_multiprocessing():
    proc = multiprocessing.get_context("spawn").Process(target=print)
    proc.start()
    proc.join()


def test_bare_through_a_fixture(server):
    assert server.poll() is None


@pytest.mark.slow
def test_slow_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_slow_through_a_fixture(server):
    assert server.poll() is None


def test_no_process():
    assert sum(range(4)) == 6
'''


def run_inner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-p", "process_guard", "-p", "no:cacheprovider", "-o", "markers=slow",
           "--strict-markers", "-rA", "-q", "test_inner.py", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def outcomes(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            out[rest.split("::", 1)[1].split(" ", 1)[0]] = word
    return out


@pytest.mark.slow  # runs pytest in a subprocess
def test_an_unmarked_test_that_starts_a_process_fails_and_a_marked_one_runs(tmp_path):
    done = run_inner(tmp_path, "-k", "not fixture or slow_through")
    assert outcomes(done.stdout) == {
        "test_bare_subprocess": "FAILED",
        "test_bare_asyncio_subprocess": "FAILED",
        "test_bare_multiprocessing": "FAILED",
        "test_slow_subprocess": "PASSED",
        "test_slow_through_a_fixture": "PASSED",
        "test_no_process": "PASSED",
    }, done.stdout + done.stderr
    assert "test_bare_subprocess starts a process" in done.stdout and "@pytest.mark.slow" in done.stdout


@pytest.mark.slow  # runs pytest in a subprocess
def test_the_fast_tier_runs_no_marked_test_and_catches_a_fixture_that_starts_a_process(tmp_path):
    # A module fixture counts for the first test that needs it: in the fast tier, an unmarked one.
    done = run_inner(tmp_path, "-m", "not slow", "-k", "fixture or no_process")
    assert outcomes(done.stdout) == {"test_bare_through_a_fixture": "ERROR", "test_no_process": "PASSED"}, (
        done.stdout + done.stderr
    )
