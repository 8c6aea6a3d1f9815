"""SLO-aware admission: admit a request now if some engine is predicted to give its
first token within the model's TTFT SLO; otherwise queue it (priority >= 0) or shed it (< 0).

Prediction for one engine (gateway/predict.py): (prefill tokens queued there + the request's
uncached tokens) / the engine's measured prefill rate. An engine with nothing queued always fits:
waiting would not make the request's own prefill shorter. "Queued there" is what the engine
reported plus what this gateway has sent it since that poll and that has no first token yet
(polls lag behind bursts).

The queue is bounded. It serves the highest priority first and, within a priority, takes tenants
in turn (deficit round robin with a quantum of one request), so one tenant's burst cannot starve
another. Every queued request has a deadline; at it, it leaves with 503.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvharbor.gateway.engines import Engine
from kvharbor.gateway.predict import predict
from kvharbor.gateway.router import Route


class Shed(Exception):
    """Refused now: sheddable traffic over the SLO, or the queue is full."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class QueueTimeout(Exception):
    """The request waited its whole deadline without an engine meeting the SLO."""


def fit_route(
    route: Route,
    engines: Sequence[Engine],
    prompt_tokens: int,
    block_size: int,
    slo_ttft_s: float,
    adapter: str | None = None,
    slo_itl_s: float = 0.0,
) -> Route | None:
    """The router's choice if its engine is predicted to meet the TTFT SLO and (`slo_itl_s` > 0)
    the ITL SLO; else the engine that does with the lowest predicted TTFT (reason "slo"); None
    when none does (queue or shed). An engine with nothing to prefill fits the TTFT rule whatever
    the request's length (waiting cannot make its own prefill shorter), and one that runs nothing
    fits the ITL rule (waiting cannot make its step faster). The ITL is the engine's measured
    decode step with one more sequence and this prompt's context (predict.py): a flood of long
    outputs makes an engine with an empty prefill queue not fit, which the TTFT rule alone never
    saw. For a LoRA `adapter` the
    TTFT counts its slot cost."""

    def ttft(e: Engine) -> float:  # with the blocks the route's index answer says e holds
        return predict(e, prompt_tokens, route.held.get(e.url, 0), block_size, adapter).ttft_s

    def itl_fits(e: Engine) -> bool:
        return slo_itl_s <= 0 or e.queue == 0 or e.predicted_itl_s(prompt_tokens) <= slo_itl_s

    fits = [e for e in engines if (e.waiting_prefill_tokens == 0 or ttft(e) <= slo_ttft_s) and itl_fits(e)]
    if route.engine in fits:
        return route
    if not fits:
        return None
    return route.to(min(fits, key=ttft), "slo")


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    enqueued: float = field(default_factory=time.monotonic)


class AdmissionQueue:
    def __init__(self, max_queue: int, timeout: float) -> None:
        self.max_queue = max_queue
        self.timeout = timeout
        # priority -> tenant -> waiters, in arrival order; tenants rotate within a priority
        self._levels: dict[int, collections.OrderedDict[str, collections.deque[_Waiter]]] = {}
        self._signal = asyncio.Event()
        self.size = 0

    def wake(self) -> None:
        """Capacity may have changed (load polled, a request started or ended): re-check the head."""
        self._signal.set()
        self._signal = asyncio.Event()

    def _head(self) -> _Waiter | None:
        if not self._levels:
            return None
        tenants = self._levels[max(self._levels)]
        return next(iter(tenants.values()))[0]

    def _remove(self, waiter: _Waiter, served: bool) -> None:
        tenants = self._levels[waiter.priority]
        queue = tenants[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del tenants[waiter.tenant]
        elif served:
            tenants.move_to_end(waiter.tenant)  # its turn is used: the next tenant goes first
        if not tenants:
            del self._levels[waiter.priority]
        self.size -= 1

    async def admit(
        self, tenant: str, priority: int, sheddable: bool, try_now: Callable[[], Awaitable[Any | None]]
    ) -> tuple[Any, float]:
        """`try_now()` returns a route when an engine meets the SLO, else None. Returns (route,
        seconds queued). Raises Shed or QueueTimeout."""
        if not self._levels:
            route = await try_now()
            if route is not None:
                return route, 0.0
        if sheddable:
            raise Shed("slo")
        if self.size >= self.max_queue:
            raise Shed("queue_full")
        waiter = _Waiter(tenant, priority)
        self._levels.setdefault(priority, collections.OrderedDict()).setdefault(tenant, collections.deque()).append(
            waiter
        )
        self.size += 1
        deadline = waiter.enqueued + self.timeout
        try:
            while True:
                signal = self._signal  # before try_now: a wake-up during it is not lost
                if self._head() is waiter:
                    route = await try_now()
                    if route is not None:
                        self._remove(waiter, served=True)
                        self.wake()  # the next head may fit too
                        return route, time.monotonic() - waiter.enqueued
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeout()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(signal.wait(), timeout=min(remaining, 0.1))
        except BaseException:
            if waiter in self._levels.get(priority, {}).get(tenant, ()):
                self._remove(waiter, served=False)
                self.wake()
            raise
