"""`kvharbor serve`: load the model, warm up, then serve OpenAI's API on uvicorn.

Options are flags, KVHARBOR_* variables or a YAML file (--config), with the same names. SIGTERM
(or Ctrl-C) drains: /ready turns false, new requests get 503, in-flight ones finish (up to
--drain-timeout, then they are aborted), and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from kvharbor.common.config import config_from_argv
from kvharbor.common.http_server import bind_listeners, uvicorn_config
from kvharbor.common.logs import setup_logging
from kvharbor.common.machine import pin_to_cpus
from kvharbor.common.redis_client import credentials_refused

log = logging.getLogger("kvharbor.engine.serve.server")


def main(argv: list[str], prog: str = "kvharbor serve", command: str = "serve") -> int:
    from kvharbor.engine.config import ServeConfig

    config = config_from_argv(ServeConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    if credentials_refused(config.server.redis_url, prog):  # a wrong password stops here, not in retries
        return 2
    try:
        pin_to_cpus(config.engine.runtime.cpu_affinity)  # before the core process starts: it inherits it
        server = build_server(config)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"kvharbor serve: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvharbor serve: error: cannot listen on {exc.strerror}; pick another port", file=sys.stderr)
        return 2
    return server.serve_forever()


class EngineServer:
    """The API server and its engine core process (engine/serve/core_client.py), started and stopped
    together: the core loads the model and warms up before uvicorn takes a connection."""

    def __init__(self, config: Any) -> None:
        from kvharbor.common.tracing import setup_tracing
        from kvharbor.engine.serve.api_server import ServerState, build_app
        from kvharbor.engine.serve.core_client import CoreClient
        from kvharbor.engine.serve.metrics import ServerMetrics
        from kvharbor.engine.serve.slo_window import SLOWindow

        srv = config.server
        # Bound before the model load, so a taken port fails at once; held until uvicorn serves on them.
        self.sockets = bind_listeners(srv.host, srv.port, srv.admin_port)
        self.instance_id = srv.instance_id or f"{socket.gethostname()}-{srv.port}"
        config = dataclasses.replace(config, server=dataclasses.replace(srv, instance_id=self.instance_id))
        if srv.allow_runtime_lora and not config.engine.lora.enabled:  # adapters loaded later need the slots
            lora = dataclasses.replace(config.engine.lora, enable_lora=True)
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, lora=lora))
        self.core = CoreClient(config)
        self.core.start_sync()
        self.metrics = ServerMetrics(lambda: (self.core.load, self.core.stats), self.core.model_name, self.instance_id)
        self.state = ServerState(
            self.core,
            self.metrics,
            self.instance_id,
            srv.max_body_bytes,
            limits=config.engine.limits,
            max_waiting=(srv.max_waiting_requests, srv.max_waiting_tokens),
            shared_store=bool(srv.redis_url),
            allow_runtime_lora=srv.allow_runtime_lora,
            slo=SLOWindow(srv.slo_ttft_ms / 1000, srv.slo_itl_ms / 1000, srv.slo_window),
            tracer=setup_tracing("engine", srv.otlp_endpoint),
        )
        app = build_app(self.state, lifespan=self._lifespan, admin_port=srv.admin_port)
        uv_config = uvicorn_config(app, srv.host, srv.port, header_timeout=srv.header_timeout)
        self.server = DrainingServer(uv_config, self.state, srv.drain_timeout)
        self.config = config

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Any) -> AsyncIterator[None]:
        await self.core.attach()
        try:
            yield
        finally:
            await self.core.stop()
            from kvharbor.common.tracing import shutdown

            shutdown()  # flushes spans still batched

    def serve_forever(self) -> int:
        srv = self.config.server
        url = f"http://{srv.host}:{srv.port}"
        model = self.core.model_name
        admin = f"http://{srv.host}:{srv.admin_port}" if srv.admin_port else url
        log.info("serving", extra={"url": url, "admin_url": admin, "model": model, "instance_id": self.instance_id})
        print(
            f"[kvharbor] serving {model} on {url}, metrics on {admin}/metrics  (Ctrl-C drains and stops)\n"
            f"[kvharbor] try: curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", '
            f'"content": "What is the capital of France?"}}], "temperature": 0}}\'',
            file=sys.stderr,
            flush=True,
        )
        try:
            self.server.run(sockets=self.sockets)
        finally:
            self.core.kill()
        return 0 if self.core.error is None else 1


def build_server(config: Any) -> EngineServer:
    return EngineServer(config)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once."""

    def __init__(self, config: Any, state: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self._drain_requested and self._loop is not None and sig in (signal.SIGTERM, signal.SIGINT):
            self._drain_requested = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    async def _drain(self) -> None:
        loop = self.state.loop
        self.state.draining = True
        log.info("draining", extra={"in_flight": loop.num_in_flight, "timeout_s": self.drain_timeout})
        deadline = time.monotonic() + self.drain_timeout
        while loop.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if loop.num_in_flight:
            log.warning("drain timeout: aborting requests still in flight", extra={"in_flight": loop.num_in_flight})
            loop.abort_all()
            stop_waiting = time.monotonic() + 2.0
            while loop.num_in_flight and time.monotonic() < stop_waiting:
                await asyncio.sleep(0.05)
        log.info("drained; stopping")
        self.should_exit = True
