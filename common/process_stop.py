"""stop_process: end a child process politely, then for sure, and reap it."""

from __future__ import annotations

import signal
import subprocess


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
