"""EngineLoop: one thread owns the engine core; async code talks to it through commands.

The core is single-threaded by design: `add_request`, `abort` and `stop_sample` may only run
between steps. So the loop thread alternates

    drain the inbox (add, abort, stop, call)  ->  core.step()  ->  deliver(outputs, now)

and sleeps on an event when idle. It runs in the engine core's process (engine/serve/core_process.py),
beside an asyncio loop that talks to the API server and to Redis; torch and the CPU kernels
release the GIL while they run, so that loop keeps up while a step runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvharbor.common.load_report import LoadReport
from kvharbor.engine.core import EngineCore
from kvharbor.engine.core_io import CoreOutput, CoreStats, EngineDead, EngineRequest

log = logging.getLogger("kvharbor.engine.loop")


class EngineLoop:
    def __init__(
        self,
        engine: EngineCore,
        deliver: Callable[[list[CoreOutput], float], None],
        event_sink: Callable[[list], None] | None = None,
        on_death: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.engine = engine
        self._deliver = deliver  # the step's outputs and when they were made (engine thread)
        self._event_sink = event_sink
        self._on_death = on_death
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._in_flight: set[str] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvharbor-engine", daemon=True)
        self.error: BaseException | None = None
        self.load: LoadReport = engine.load()  # replaced (atomically) after every step
        self.stats = CoreStats()  # replaced (atomically) with the load report
        self._aborted = 0  # requests cancelled in flight (their count is this loop's to keep)

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
        return len(self._in_flight)

    def add(self, request: EngineRequest) -> concurrent.futures.Future[int]:
        """Queue a request. The future gives the prefix blocks imported for it, or the engine's
        ValueError for bad input; EngineDead is raised at once if the loop stopped."""
        self._check_alive()
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._send(("add", request, done))
        return done

    def stop_sample(self, request_id: str, index: int, num_output_tokens: int, stop_string: str) -> None:
        """A stop string ended a sample (engine/output_processor.py): retire it before the next step."""
        self._send(("stop", request_id, index, num_output_tokens, stop_string))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step. Unknown ids are ignored."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Cancel every request in flight (drain timeout)."""
        self._send(("abort_all",))

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(engine)` in the engine thread between two steps; the future gives its result."""
        self._check_alive()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(("call", fn, done))
        return done

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
                elif self.engine.handoffs.expire():  # leases end on time on an idle engine too
                    self._refresh()
                self._refresh()
                if not busy:
                    self._wake.wait(timeout=0.5)
        except BaseException as exc:
            log.exception("engine loop stopped")
            self.error = exc
            self._in_flight.clear()
            self._fail_inbox(exc)
            self._on_death(exc)

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
                if command[1] in self._in_flight:
                    self._aborted += 1
                self.engine.abort(command[1])
            elif kind == "stop":
                self.engine.stop_sample(*command[1:])
            elif kind == "abort_all":
                for request_id in list(self._in_flight):
                    self._aborted += 1
                    self.engine.abort(request_id)
            elif kind == "call":
                _, fn, done = command
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:
                    done.set_exception(exc)

    def _add(self, request: EngineRequest, done: concurrent.futures.Future) -> None:
        ext = request.external_prefix
        imported = 0
        if ext is not None:
            try:
                imported = self.engine.import_prefix(ext.hashes, ext.payloads, ext.prefix)
            except Exception:
                log.exception("could not load pulled KV blocks; computing the prefill instead")
        try:
            self.engine.add_request(request)
        except Exception as exc:
            done.set_exception(exc)
            return
        self._in_flight.add(request.request_id)
        done.set_result(imported)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        self._refresh()  # the load that goes with these outputs: never older than they are
        self._deliver(outputs, now)
        if self._event_sink is not None:
            events = self.engine.pool.take_events()
            if events:
                self._event_sink(events)

    def _refresh(self) -> None:
        # Readers on other threads see whole objects: each is replaced, never mutated.
        self.stats = self.engine.counters(self._aborted)
        self.load = self.engine.load()

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] in ("add", "call"):
                command[-1].set_exception(EngineDead(f"the engine loop stopped: {exc!r}"))
