"""CoreClient: the API server's side of its engine core process.

It starts `python -m kvharbor.engine.serve.core_process` as a child joined by a socket pair
(framed by engine/link_frames.py), sends it requests as token ids and sampling options, and turns
the token deltas it sends back into RequestOutputs (engine/output_processor.py: text, stop
strings), one RequestStream per request. A stop string is told back to the core, which retires the
sample. The messages:

    API server -> core                        core -> API server
    ["config", pickled ServeConfig] (first)   ["ready", info] (or ["failed", reason])
    ["add", EngineRequest wire]               ["added", id, imported | None, error | None,
                                                core_io.error_kind | None, field | None]
    ["lora", op, "load"|"unload", name,       ["lora_done", op, error | None, error kind | None,
     path | None]                               LoadReport json | None]
    ["abort", id] / ["abort_all"]             ["out", now, [CoreOutput wire, ...], LoadReport json,
                                                CoreStats wire]
    ["stop", id, index, n_tokens, string]     ["load", LoadReport json, CoreStats wire]
    ["reuse", prompt, cached, pulled]         ["dead", error]
    ["shutdown"]


Death is loud on both sides: when the core process dies, every open stream ends with EngineDead,
`alive` turns false (so /ready and /health say 503) and new requests get 503; when this process
dies, the core sees its link close and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from kvharbor.common.load_report import LoadReport
from kvharbor.common.model_files import load_tokenizer
from kvharbor.common.process_stop import stop_process
from kvharbor.engine.core_io import ERROR_KINDS, CoreOutput, CoreStats, EngineDead, EngineRequest
from kvharbor.engine.link_frames import LinkClosed, encode, read_message, read_message_sync
from kvharbor.engine.output_processor import OutputProcessor
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.pooling import Pooling

log = logging.getLogger("kvharbor.engine.serve.core_client")


class CoreStalled(RuntimeError):
    """The engine core did not answer a request's add within core_add_timeout (the API's 504)."""


class RequestStream:
    """The outputs of one request, in order; the last has `finished` set. Each item carries the
    monotonic time the core produced it (for TTFT/ITL)."""

    def __init__(self) -> None:
        self.imported_blocks = 0  # prefix blocks loaded from the shared store for this request
        self._queue: asyncio.Queue[tuple[RequestOutput, float] | BaseException] = asyncio.Queue()

    def put(self, item: tuple[RequestOutput, float] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[tuple[RequestOutput, float]]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[0].finished:
                return


@dataclasses.dataclass(frozen=True)
class CoreInfo:
    """What the core process says of itself once its model is loaded and warmed up."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    role: str = "both"
    kv_transfer_port: int = 0  # where decode engines pull this engine's hand-offs (0: none)
    kv_transfer_secret: bytes = dataclasses.field(default=b"", repr=False)  # signs the handles (handoff_handles.py)
    pooling: Pooling | None = None  # an embedding engine's (engine/pooling.py); None: it generates
    hidden_size: int = 0  # an embedding's length


class CoreClient:
    def __init__(self, config: Any) -> None:
        self.config = config
        model = config.engine.model
        self.model_name, self.tokenizer = load_tokenizer(model.model, model.served_model_name)
        self.processor = OutputProcessor(self.tokenizer)
        self.info: CoreInfo | None = None
        self.error: BaseException | None = None
        self.load = LoadReport(model=self.model_name)
        self.stats = CoreStats()
        self.proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[str, RequestStream] = {}
        self._waiting: dict[str, int] = {}  # requests with no output yet -> their prompt tokens
        self._added: dict[str, asyncio.Future] = {}
        self._lora_ops: dict[int, asyncio.Future] = {}
        self._ops = 0
        self.heard_at = time.monotonic()  # when the core last sent anything (it reports its load every 50 ms)
        self._reader_task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self._stopping = False

    # -- life ----------------------------------------------------------------------------------------

    def start_sync(self, timeout: float | None = None) -> CoreInfo:
        """Start the core process and wait (blocking: before any event loop runs) until its model is
        loaded and warmed up. Raises ValueError for what the core refused (a bad model path, a KV
        pool too small) and RuntimeError if it exits first."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "kvharbor.engine.serve.core_process", "--link-fd", str(theirs.fileno())]
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=os.environ.copy())
        theirs.close()
        if nice := self.config.server.api_server_nice:
            # NOTE: the core's step is what every request waits on. On few cores, HTTP work (a flood
            # of /metrics polls, many SSE clients) would take its CPU; at a lower priority the API
            # server gets what the core leaves. Lowering one's own priority needs no privilege.
            with contextlib.suppress(OSError):
                os.nice(nice)
        self._sock = ours
        ours.settimeout(timeout)
        ours.sendall(encode(["config", pickle.dumps(self.config)]))  # once; frozen dataclasses
        try:
            first = read_message_sync(ours)
        except LinkClosed:
            code = self.proc.wait(30)
            raise RuntimeError(f"the engine core process exited with code {code} while starting") from None
        finally:
            ours.settimeout(None)
        if first[0] == "failed":
            self.proc.wait(30)
            raise ValueError(first[1])
        info = first[1]
        secret = bytes.fromhex(info["kv_transfer_secret"])
        pooling = Pooling(*info["pooling"]) if info.get("pooling") else None
        self.load = LoadReport.from_json(info["load"])
        self.info = CoreInfo(info["model"], info["max_model_len"], info["vocab_size"], info["block_size"],
                             info["role"], info["kv_transfer_port"], secret, pooling, info["hidden_size"])  # fmt: skip
        return self.info

    async def attach(self) -> None:
        """Hand the link to the running event loop (uvicorn's): from here on outputs flow."""
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self._reader_task = asyncio.create_task(self._read(reader))

    def kill(self) -> None:
        """Stop the core process at once if it still runs (after the server stopped): SIGKILL, since
        it ignores SIGTERM (the API server drains first, then stops it over the link: stop())."""
        if self.proc is not None:
            stop_process(self.proc, sig=signal.SIGKILL)

    async def stop(self, timeout: float = 30.0) -> None:
        """Ask the core process to stop, then wait for it (killed after `timeout`)."""
        self._stopping = True
        if self._writer is not None and not self._writer.is_closing():
            with contextlib.suppress(Exception):
                self._writer.write(encode(["shutdown"]))
                await self._writer.drain()
        if self.proc is not None:
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc is not None and self.proc.poll() is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def queued(self) -> tuple[int, int]:
        """Requests sent to the core that have no output yet, and their prompt tokens: this
        engine's queue as its API server counts it (exact, unlike a load report's snapshot)."""
        return len(self._waiting), sum(self._waiting.values())

    # -- requests ------------------------------------------------------------------------------------

    async def add(self, request: EngineRequest) -> RequestStream:
        """Queue a request in the core; raises its ValueError for bad input, EngineDead if it is gone."""
        return await self.taken(self.submit(request))

    def submit(self, request: EngineRequest) -> str:
        """Send a request to the core now (no await: a caller that checked the queue first takes
        its place at once); `taken` waits for the core's answer. Raises ValueError or EngineDead."""
        self._check_alive()
        rid = request.request_id
        if rid in self._streams or rid in self._added:
            raise ValueError(f"request id {rid!r} is already in use")
        self._added[rid] = asyncio.get_running_loop().create_future()
        # NOTE: tracked before the core hears of it: its first outputs may overtake the reply.
        self._streams[rid] = RequestStream()
        self._waiting[rid] = len(request.prompt_token_ids)
        self.processor.add(rid, None, request.prompt_token_ids, request.params)
        try:
            self._send(["add", request.to_wire()])
        except OverflowError:  # the link packs 64-bit integers (a fuzzed seed of 2**64 reached here)
            self._forget(rid)
            raise ValueError("an integer in the request is out of range (64 bits)") from None
        return rid

    async def taken(self, rid: str) -> RequestStream:
        """The stream of a submitted request, once the core took it (within core_add_timeout);
        raises the core's error for it, CoreStalled past the timeout (the request aborted)."""
        timeout = self.config.server.core_add_timeout
        stream = self._streams[rid]
        try:
            try:
                stream.imported_blocks = await asyncio.wait_for(self._added[rid], timeout)
            except TimeoutError:
                self.abort(rid)  # should the core take it after all, it ends there at once
                raise CoreStalled(
                    f"the engine core did not take the request within {timeout:g} s (core_add_timeout)"
                ) from None
        except BaseException:
            self._forget(rid)
            raise
        finally:
            self._added.pop(rid, None)
        return stream

    def _forget(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._waiting.pop(rid, None)
        self._added.pop(rid, None)
        self.processor.forget(rid)

    async def lora(self, action: str, name: str, path: str | None = None) -> None:
        """Load (`action` "load", from `path`) or unload a LoRA adapter in the core. Raises
        UnknownModel, AdapterInUse or ValueError as the core did; the load report is updated first."""
        self._check_alive()
        self._ops += 1
        op, done = self._ops, asyncio.get_running_loop().create_future()
        self._lora_ops[op] = done
        self._send(["lora", op, action, name, path])
        try:
            await done
        finally:
            self._lora_ops.pop(op, None)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the core's next step. Unknown ids are ignored."""
        if self.alive:
            self._send(["abort", request_id])

    def abort_all(self) -> None:
        if self.alive:
            self._send(["abort_all"])

    def record_reuse(self, prompt_tokens: int, cached_tokens: int, pulled_blocks: int) -> None:
        """One finished request, for the shared store's reuse counters (the core owns the store)."""
        if self.alive:
            self._send(["reuse", prompt_tokens, cached_tokens, pulled_blocks])

    def _send(self, message: list) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode(message))

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDead(f"the engine core process is gone: {self.error!r}")

    # -- what the core sends -------------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader)
                self.heard_at = time.monotonic()
                kind = message[0]
                if kind == "out":
                    self.load, self.stats = LoadReport.from_json(message[3]), CoreStats.from_wire(message[4])
                    self._deliver(message[1], [CoreOutput.from_wire(o) for o in message[2]])
                elif kind == "load":
                    self.load, self.stats = LoadReport.from_json(message[1]), CoreStats.from_wire(message[2])
                elif kind == "added":
                    self._answer(*message[1:])
                elif kind == "lora_done":
                    self._lora_done(*message[1:])
                elif kind == "dead":
                    self._fail(EngineDead(message[1]))
        except LinkClosed:
            if self._stopping:
                return  # we asked it to stop
            code = self.proc.poll() if self.proc is not None else None
            self._fail(EngineDead(f"the engine core process exited (code {code})"))

    def _deliver(self, now: float, outputs: list[CoreOutput]) -> None:
        for out in outputs:
            self._waiting.pop(out.request_id, None)
        results, stops = self.processor.process(outputs)
        for stop in stops:
            self._send(["stop", stop.request_id, stop.index, stop.num_output_tokens, stop.stop_string])
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put((out, now))
            if out.finished:
                del self._streams[out.request_id]

    def _answer(self, rid: str, imported: int | None, error: str | None, kind: str | None, field: str | None) -> None:
        _settle(self._added.get(rid), imported, error, kind, field)

    def _lora_done(self, op: int, error: str | None, kind: str | None, report: dict | None) -> None:
        if report is not None:
            self.load = LoadReport.from_json(report)
        _settle(self._lora_ops.get(op), None, error, kind)

    def _fail(self, exc: EngineDead) -> None:
        if self.error is None:
            log.error("the engine core process died; every open request fails", extra={"error": str(exc)})
        self.error = exc
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()
        self._waiting.clear()
        for done in [*self._added.values(), *self._lora_ops.values()]:
            if not done.done():
                done.set_exception(exc)
        self.processor.forget_all()


def _settle(
    done: asyncio.Future | None, result: Any, error: str | None, kind: str | None, field: str | None = None
) -> None:
    """Answer a waiting add or adapter operation: its result, or the core's error raised again
    (with the request field it names, as `field`)."""
    if done is None or done.done():
        return
    if error is not None:
        exc = ERROR_KINDS.get(kind, ValueError)(error)
        exc.field = field
        done.set_exception(exc)
    else:
        done.set_result(result)
