"""The engine core process of `kvharbor serve`: the EngineCore on its thread (engine_loop.py), and
an asyncio loop for everything else the core owns: the link to the API server (engine/link_frames.py), the
KV event publisher and the shared block store client (both talk to Redis).

    python -m kvharbor.engine.serve.core_process --link-fd N

The API server starts it (engine/serve/core_client.py) and sends the ServeConfig as the first message.
It exits when the link closes: the API server died or stopped it. Ctrl-C reaches the whole
process group, so it ignores SIGINT and lets the API server drain and stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import pickle
import secrets
import signal
import socket
import threading
import time
from typing import Any

from kvharbor.common.logs import setup_logging
from kvharbor.common.process_stop import die_with_parent
from kvharbor.engine.core_io import (
    EngineDead,
    EngineRequest,
    HandoffFailed,
    KVTransfer,
    StructuredOutputError,
    error_kind,
)
from kvharbor.engine.link_frames import LinkClosed, encode, read_message
from kvharbor.engine.serve.engine_loop import EngineLoop

log = logging.getLogger("kvharbor.engine.core")
LOAD_INTERVAL_S = 0.05  # how often the API server's /load and /metrics snapshot is refreshed


class CoreProcess:
    def __init__(self, config: Any, writer: asyncio.StreamWriter) -> None:
        from kvharbor.engine.core import EngineCore

        self.config = config
        self.writer = writer
        srv = config.server
        engine_config = config.engine
        if srv.redis_url:
            cache = dataclasses.replace(engine_config.cache, kv_events=True)
            engine_config = dataclasses.replace(engine_config, cache=cache)
        kv_save = srv.kv_store_push if srv.redis_url else None  # the shared store is in that Redis
        self.core = EngineCore(engine_config, progress=lambda msg: log.info(msg), kv_save=kv_save)
        # Off the engine thread, while the server starts: the first constrained request need not pay it.
        threading.Thread(target=self.core.guides.prepare, name="kvharbor-grammar-tokenizer", daemon=True).start()
        self.instance_id = srv.instance_id
        self.publisher = self._publisher(srv)
        self.kv_store = self._kv_store(srv)
        self.loop = EngineLoop(
            self.core,
            deliver=self._deliver,
            event_sink=self.publisher.sink if self.publisher else None,
            on_death=self._died,
        )
        self.handoff_secret = secrets.token_bytes(32)  # signs hand-off handles; only the API server learns it
        self.handoff_server, self.handoff_puller = self._handoffs(srv.host, engine_config.disagg)
        self.aio: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, bool] = {}  # adds not in the engine yet -> aborted meanwhile
        self._tasks: set[asyncio.Task] = set()

    def _publisher(self, srv: Any) -> Any:
        if not srv.redis_url:
            return None
        from kvharbor.common.kv_publisher import KVEventPublisher

        model = self.core.model_name
        return KVEventPublisher(
            srv.redis_url, model, self.instance_id, srv.kv_events_stream_prefix, srv.lease_ttl,
            on_published=lambda n: self.core.board.inc("kv_events_published", n),
            on_dropped=lambda n: self.core.board.inc("kv_events_dropped", n),
        )  # fmt: skip

    def _kv_store(self, srv: Any) -> Any:
        if not srv.redis_url:
            return None
        from kvharbor.engine.kv.kv_offload import KVStoreClient
        from kvharbor.kvcache_service.block_store import RedisBlockStore

        return KVStoreClient(RedisBlockStore.from_url(srv.redis_url), self.core, ask=self._ask)

    def _ask(self, fn: Any) -> Any:
        return asyncio.wrap_future(self.loop.call(fn))  # the pool is the engine thread's

    def _handoffs(self, host: str, disagg: Any) -> tuple[Any, Any]:
        from kvharbor.engine.kv.kv_handoff_link import HandoffPuller, HandoffServer

        server = None
        if disagg.transfer_port is not None:
            server = HandoffServer(self._ask, self.core.handoffs, self.core.kv_io.format, host, disagg.transfer_port,
                                   self.core.board, self.handoff_secret)  # fmt: skip
        puller = HandoffPuller(self.core, self._ask, self.core.board, disagg.kv_load_failure_policy,
                               disagg.kv_transfer_timeout)  # fmt: skip
        return server, puller

    # -- the engine thread -------------------------------------------------------------------------

    def _deliver(self, outputs: list, now: float) -> None:
        if outputs:
            wire = [o.to_wire() for o in outputs]
            message = ["out", now, wire, self.loop.load.to_json(), self._stats()]
            self.aio.call_soon_threadsafe(self._send, message)

    def _died(self, exc: BaseException) -> None:
        self.aio.call_soon_threadsafe(self._send, ["dead", f"the engine core failed: {exc!r}"])

    # -- the asyncio loop ----------------------------------------------------------------------------

    async def _snapshot(self) -> list[bytes]:
        """Every block the pool holds, read between steps (the publisher's re-sync)."""

        def read(engine) -> list[bytes]:
            self.publisher.begin_snapshot()
            engine.pool.take_events()  # superseded by the full set
            return engine.pool.cached_hashes()

        return await asyncio.wrap_future(self.loop.call(read))

    def _stats(self) -> list:
        """The loop's counters (core.counters(), at its last step) with the core's board read now:
        this process's tasks count into it between steps (a push, a hand-off). One CoreStats, as
        it crosses the link."""
        return dataclasses.replace(self.loop.stats, board=self.core.board.snapshot()).to_wire()

    def _send(self, message: list) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(message))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, reader: asyncio.StreamReader) -> None:
        self.aio = asyncio.get_running_loop()
        core = self.core
        if self.handoff_server is not None:  # before the loop: the first load report carries its port
            core.kv_transfer_port = await self.handoff_server.start()
            log.info("serving P/D hand-offs", extra={"port": core.kv_transfer_port})
        self.loop.start()
        info = {"model": core.model_name, "max_model_len": core.max_model_len, "vocab_size": core.arch.vocab_size,
                "block_size": core.capacity.block_size, "instance_id": self.instance_id,
                "role": core.config.disagg.role, "kv_transfer_port": core.kv_transfer_port,
                "kv_transfer_secret": self.handoff_secret.hex(),
                "pooling": [core.pooling.mode, core.pooling.normalize] if core.pooling else None,
                "hidden_size": core.arch.hidden_size,
                # the first load report rides along: an API server that says ready knows the
                # adapters it serves before the first periodic report (a request for one is not a 404)
                "load": self.loop.load.to_json()}  # fmt: skip
        self._send(["ready", info])
        if self.publisher is not None:
            self._spawn(self.publisher.run(self._snapshot, core.capacity.block_size))
        if self.kv_store is not None:
            self._spawn(self.kv_store.run())
        self._spawn(self._report_load())
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "shutdown":
                    return
                self._handle(message)
        except LinkClosed:
            log.info("the API server closed the engine link; stopping")
        finally:
            await self._stop()

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == "add":
            self._pending[message[1][0]] = False  # the wire form's first field is the request id
            self._spawn(self._add(message[1]))
        elif kind == "abort":
            if message[1] in self._pending:
                self._pending[message[1]] = True  # aborted while its prefix was being pulled
            self.loop.abort(message[1])
        elif kind == "abort_all":
            self._pending = dict.fromkeys(self._pending, True)
            self.loop.abort_all()
        elif kind == "stop":
            self.loop.stop_sample(*message[1:])
        elif kind == "reuse" and self.kv_store is not None:
            self._spawn(self.kv_store.record_reuse(*message[1:]))
        elif kind == "lora":
            self._spawn(self._lora(*message[1:]))
        else:
            log.warning("unknown message on the engine link; ignored", extra={"kind": str(kind)[:40]})

    async def _add(self, wire: list) -> None:
        rid = wire[0]
        try:
            request = EngineRequest.from_wire(wire)
            ids, salt, transfer = request.prompt_token_ids, request.cache_salt, request.transfer or KVTransfer()
            adapter = self.core.adapter_identity(request.lora)  # read-only here; unknown: 404 before any pull
            if transfer.do_remote_decode and not transfer.lease:
                raise ValueError("a hand-off prefill needs the lease key its API server draws")
            if request.params.structured is not None:  # compiled off the engine thread: a slow one stalls no step
                request.guide = await self._compile(request.params.structured)
                self.core.board.inc("structured_requests", label=request.params.structured["kind"])
            if transfer.remote_handle:
                request.external_prefix = await self.handoff_puller.pull(ids, salt, transfer, adapter)
            elif request.kv_prefix_source == "shared" and self.kv_store is not None:
                request.external_prefix = await self.kv_store.pull(ids, salt, adapter)
            imported = await asyncio.wrap_future(self.loop.add(request))
        except (ValueError, TypeError, EngineDead, HandoffFailed) as exc:
            self._pending.pop(rid, None)
            self._send(["added", rid, None, str(exc), error_kind(exc), getattr(exc, "field", None)])
            return
        except Exception as exc:  # NOTE: every add is answered: its API server waits on the reply
            log.exception("taking a request failed in the engine core", extra={"request_id": rid})
            self._pending.pop(rid, None)
            self._send(["added", rid, None, f"the engine failed while taking the request: {exc!r}"[:500], "internal",
                        None])  # fmt: skip
            return
        if transfer.remote_handle:
            self.core.board.inc("kv_handoff_pulled_blocks", imported)
        elif self.kv_store is not None and imported:
            self.kv_store.pulled(imported)
        if self._pending.pop(rid, False):
            self.loop.abort(rid)
        self._send(["added", rid, imported, None, None, None])

    async def _compile(self, spec: dict) -> Any:
        """The spec's Guide, compiled on a worker thread within structured_compile_timeout
        (llguidance's fuel bounds the work; this bounds the wait, a queue of compiles included)."""
        timeout = self.core.config.structured.structured_compile_timeout
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.core.guides.guide, spec), timeout)
        except TimeoutError:
            raise StructuredOutputError(
                f"the {spec['kind']} spec did not compile within {timeout:g} s (structured_compile_timeout): "
                "simplify it"
            ) from None

    async def _lora(self, op: int, action: str, name: str, path: str | None) -> None:
        """Load (read off the engine thread, installed between steps) or unload an adapter."""
        from kvharbor.engine.lora.adapter import load_adapter

        core = self.core
        try:
            if action == "load":
                lora = core.config.lora
                if core.loras is None:
                    raise ValueError("this engine serves no LoRA adapters: start it with --enable-lora or --lora")
                adapter = await asyncio.to_thread(load_adapter, name, path, core.arch, lora.max_lora_rank)
                report = await asyncio.wrap_future(self.loop.call(lambda c: (c.load_lora(adapter), c.load())[1]))
            else:
                report = await asyncio.wrap_future(self.loop.call(lambda c: (c.unload_lora(name), c.load())[1]))
        except (ValueError, EngineDead) as exc:
            self._send(["lora_done", op, str(exc), error_kind(exc), None])
            return
        # The loop's cached report is refreshed after each step; an idle engine runs none, and the
        # next periodic report would take the adapter back out of the front end's list.
        self.loop.load = report
        self._send(["lora_done", op, None, None, report.to_json()])  # the reply carries the new adapter list

    async def _report_load(self) -> None:
        while True:
            self._send(["load", self.loop.load.to_json(), self._stats()])
            await asyncio.sleep(LOAD_INTERVAL_S)

    async def _stop(self) -> None:
        if self.handoff_server is not None:
            await self.handoff_server.stop()
        self.loop.stop()
        if self.publisher is not None:
            await self.publisher.stop()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.kv_store is not None:
            await self.kv_store.stop()
        with contextlib.suppress(Exception):
            self.writer.close()


async def serve_link(sock: socket.socket) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    config = pickle.loads((await read_message(reader))[1])  # once, at start: a frozen ServeConfig
    setup_logging(config.server.log_level, config.server.log_json)
    try:
        core = CoreProcess(config, writer)
    except (FileNotFoundError, ValueError, OSError) as exc:
        writer.write(encode(["failed", str(exc)]))
        await writer.drain()
        return 2
    await core.run(reader)
    return 0 if core.loop.error is None else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvharbor's engine core process (started by `kvharbor serve`)")
    ap.add_argument("--link-fd", type=int, required=True, help="the socket to the API server")
    args = ap.parse_args(argv)
    # NOTE: Ctrl-C, systemd's default KillMode, dumb-init and a terminal's job control signal the
    # whole process group. The API server drains on SIGTERM/SIGINT, then stops this process over the
    # link (and a closed link stops it too): a core that died on the signal failed every in-flight
    # request, and `kvharbor serve` exited 1.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Ignoring SIGTERM, a core whose API server died during start-up (before it reads the link)
    # would go on loading the model alone: it dies with its parent instead.
    die_with_parent(signal.SIGKILL)
    sock = socket.socket(fileno=args.link_fd)
    started = time.monotonic()
    code = asyncio.run(serve_link(sock))
    log.info("engine core stopped", extra={"seconds": round(time.monotonic() - started, 1)})
    return code


if __name__ == "__main__":
    raise SystemExit(main())
