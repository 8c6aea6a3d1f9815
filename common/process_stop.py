"""stop_process: end a child process politely, then for sure, and reap it; die_with_parent: a
child's own end when its parent dies first."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux's PR_SET_PDEATHSIG;
    elsewhere nothing). Call it in the child: a preexec_fn, or first thing in its main()."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
    """Send `sig` (SIGTERM: let it clean up) and wait `grace` seconds, then SIGKILL it. Returns its
    exit code; a process that already exited is only reaped."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)
