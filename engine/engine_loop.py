"""EngineLoop: one thread owns the LLMEngine; async code talks to it through commands.

The engine is single-threaded by design: `add_request` and `abort` may only run between steps.
So the loop thread alternates

    drain the inbox (add, abort, call)  ->  engine.step()  ->  hand outputs to request streams

and sleeps on an event when idle. torch releases the GIL inside its kernels, so the asyncio
event loop keeps serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvharbor.common.load_report import LoadReport
from kvharbor.engine.llm_engine import LLMEngine
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.sampling_params import SamplingParams

log = logging.getLogger("kvharbor.engine.loop")


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    external_prefix: Any = None  # kv_offload.ExternalPrefix: blocks to load into the cache first


class RequestStream:
    """The outputs of one request, in order; the last has `finished` set. Each item carries the
    monotonic time the loop produced it (for TTFT/ITL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.imported_blocks = 0  # prefix blocks loaded from the shared store for this request
        self._loop = loop
        self._queue: asyncio.Queue[tuple[RequestOutput, float] | BaseException] = asyncio.Queue()

    def put(self, item: tuple[RequestOutput, float] | BaseException) -> None:
        """Thread-safe: called from the engine thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[tuple[RequestOutput, float]]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[0].finished:
                return


class EngineDead(RuntimeError):
    """The engine loop stopped on an unexpected error; the process should be restarted."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        event_sink: Callable[[list], None] | None = None,
        after_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self._event_sink = event_sink
        self._after_step = after_step  # runs in the engine thread after each step (KV copy-out)
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvharbor-engine", daemon=True)
        self.error: BaseException | None = None
        self.load: LoadReport = engine.load()  # replaced (atomically) after every step
        self.counters: dict[str, int] = {
            "prefix_queries": 0, "prefix_hits": 0, "aborted": 0, "spec_verifications": 0, "spec_proposed": 0,
            "spec_accepted": 0,
        }  # fmt: skip

    # -- control (any thread) ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def add(self, request: NewRequest) -> RequestStream:
        """Queue a request; raises the engine's ValueError for bad input, EngineDead if stopped."""
        self._check_alive()
        stream = RequestStream(asyncio.get_running_loop())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(("add", request, stream, done))
        await asyncio.wrap_future(done)
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step. Unknown ids are ignored."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Cancel every request in flight (drain timeout)."""
        self._send(("abort_all",))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` in the engine thread between two steps and return its result."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _check_alive(self) -> None:
        if self.error is not None or self._stopping:
            raise EngineDead(f"the engine loop has stopped: {self.error!r}")

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._drain_inbox()
                busy = self.engine.has_unfinished()
                if busy:
                    self._step()
                self._refresh()
                if not busy:
                    self._wake.wait(timeout=0.5)
        except BaseException as exc:
            log.exception("engine loop stopped")
            self.error = exc
            for stream in self._streams.values():
                stream.put(EngineDead(f"the engine loop stopped: {exc!r}"))
            self._streams.clear()
            self._fail_inbox(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                if command[1] in self._streams:
                    self.counters = {**self.counters, "aborted": self.counters["aborted"] + 1}
                self.engine.abort(command[1])
            elif kind == "abort_all":
                for request_id in list(self._streams):
                    self.counters = {**self.counters, "aborted": self.counters["aborted"] + 1}
                    self.engine.abort(request_id)
            elif kind == "call":
                _, fn, done = command
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:
                    done.set_exception(exc)

    def _add(self, request: NewRequest, stream: RequestStream, done: concurrent.futures.Future) -> None:
        ext = request.external_prefix
        if ext is not None:
            try:
                stream.imported_blocks = self.engine.import_prefix(ext.hashes, ext.payloads, ext.prefix)
            except Exception:
                log.exception("could not load pulled KV blocks; computing the prefill instead")
        try:
            self.engine.add_request(
                request.request_id,
                None,
                request.params,
                prompt_token_ids=request.prompt_token_ids,
                priority=request.priority,
                tenant=request.tenant,
                cache_salt=request.cache_salt,
                arrival_time=request.arrival_time,
            )
        except Exception as exc:
            done.set_exception(exc)
            return
        self._streams[request.request_id] = stream
        done.set_result(None)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put((out, now))
                if out.finished:
                    del self._streams[out.request_id]
        if self._after_step is not None:
            self._after_step(self.engine)
        if self._event_sink is not None:
            events = self.engine.pool.take_events()
            if events:
                self._event_sink(events)

    def _refresh(self) -> None:
        # Readers on other threads see whole dicts: each is replaced, never mutated.
        kv, stats = self.engine.kv, self.engine.stats
        self.counters = {
            **self.counters,
            "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits,
            "spec_verifications": stats.spec_verifications,
            "spec_proposed": stats.spec_proposed,
            "spec_accepted": stats.spec_accepted,
        }
        self.load = self.engine.load()

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call"):
                command[-1].set_exception(EngineDead(f"the engine loop stopped: {exc!r}"))
