"""A pytest plugin that keeps the two test tiers honest: a test that starts a process must carry
`@pytest.mark.slow`, so that `make test-fast` (`-m "not slow"`) never starts one.

It wraps the few calls every way of starting a program goes through (subprocess, asyncio's
subprocesses, multiprocessing, os.fork/posix_spawn/exec*) and, while a test without the marker is
set up, run or torn down, fails that test at the call, naming what it tried to start. Session and
module fixtures count for the first test that needs them, so that test must be slow too.

It also lists, at the end of a run, the unmarked tests that took longer than SLOW_NOTE_S: a hint
to mark them, never a failure (tests do not assert on wall-clock time).
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import time

import pytest

SLOW_NOTE_S = 10.0
_EXEC_NAMES = ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe")


class UnmarkedProcessError(RuntimeError):
    """Raised in a test without the `slow` marker at the moment it starts a process."""


class ProcessGuard:
    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.durations: dict[str, float] = {}
        self._saved: list[tuple[object, str, object]] = []

    # -- patching ---------------------------------------------------------------------------------

    def install(self) -> None:
        self._wrap(subprocess.Popen, "_execute_child")  # also asyncio's subprocesses
        self._wrap(_posixsubprocess, "fork_exec")  # multiprocessing's spawn and forkserver
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", *_EXEC_NAMES):
            if hasattr(os, name):
                self._wrap(os, name)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def guarded(*args, **kwargs):
            self.check(name, args)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, guarded)

    def check(self, how: str, args: tuple) -> None:
        item = self.item
        if item is None or item.get_closest_marker("slow") is not None:
            return
        raise UnmarkedProcessError(
            f"{item.nodeid} starts a process ({how}: {_describe(args)}) but has no @pytest.mark.slow; "
            "mark it slow (or its module: pytestmark = pytest.mark.slow) so the fast tier never starts one"
        )

    # -- hooks --------------------------------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        self.item = item
        started = time.monotonic()
        try:
            yield
        finally:
            self.item = None
            if item.get_closest_marker("slow") is None:
                self.durations[item.nodeid] = time.monotonic() - started

    def pytest_terminal_summary(self, terminalreporter) -> None:
        long = sorted(((s, n) for n, s in self.durations.items() if s > SLOW_NOTE_S), reverse=True)
        if long:
            terminalreporter.section(f"unmarked tests slower than {SLOW_NOTE_S:.0f} s (consider @pytest.mark.slow)")
            for seconds, nodeid in long:
                terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")


def _describe(args: tuple) -> str:
    for arg in args:  # the program: fork_exec's and exec*'s first list or path argument
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], (str, bytes)):
            return " ".join(os.fsdecode(a) for a in arg[:6])
        if isinstance(arg, (str, bytes)):
            return os.fsdecode(arg)
    return "fork"


_guard = ProcessGuard()


def pytest_configure(config: pytest.Config) -> None:
    _guard.install()
    config.pluginmanager.register(_guard, "kvharbor-process-guard")


def pytest_unconfigure(config: pytest.Config) -> None:
    _guard.uninstall()
