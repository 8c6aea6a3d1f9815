"""The engine instances behind the gateway, their load, and their health.

Active checks: every `interval` each engine's `/load` is polled (each engine on its own: a slow one
holds up no other's); it tells the load (common/load_report.py) and, by answering, that the engine
is alive. Passive checks: the proxy reports failed calls. `eject_after` consecutive failures (or
one refused connection) eject an engine from routing; it keeps being polled and returns with its
first good answer. A draining engine is not routed to.

Busy is not dead (DESIGN.md). A /load answer that comes late, or not within a poll's timeout, is
what a busy engine does (its API server runs at a lower CPU priority than its core): it counts
as nothing until the engine has gone `stall_timeout` seconds without an answer. An engine that
answers but whose core has stalled (its `steps` stand still while it has requests, or its API
server has not heard from the core: `core_silent_s`) is ejected after the same time. An ejection
moves the requests still waiting on that engine for their first token (Engine.lost).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvharbor.common.load_report import LoadReport, LoadReportError
from kvharbor.gateway.engine_kinds import KINDS, KVHARBOR, EngineKind, engine_kind

log = logging.getLogger("kvharbor.gateway.engines")
COOLDOWN_S = 5.0
# A request sent this long before a poll may not be in the engine's scheduler yet when /load
# answers: it is counted as unseen (counting it twice for a moment errs toward spreading a burst).
SEND_LAG_S = 0.05


@dataclass(eq=False)
class Sent:
    """One request this gateway has open on an engine (Engine.send)."""

    engine: Engine
    at: float
    prefill: int  # prompt tokens still to prefill; 0 once the first token came
    adapter: str | None = None  # the LoRA adapter it runs on (its name); None: the base model
    prompt: int = 0  # all its prompt tokens: the context it adds to the engine's decode steps

    def first_token(self) -> None:
        self.prefill = 0

    def done(self) -> None:
        self.engine.sent.discard(self)


@dataclass
class Engine:
    url: str
    model: str
    instance_id: str | None = None  # from /load (a vLLM engine's: from its address): the id its KV events carry
    load: LoadReport = field(default_factory=LoadReport)
    polled: bool = False
    ejected: bool = False
    draining: bool = False
    failures: int = 0
    cooldown_until: float = 0.0  # after failed calls, a good /load alone does not bring it back before this
    polled_at: float = 0.0  # when the poll that brought `load` was sent
    sent: set[Sent] = field(default_factory=set)  # requests this gateway has open on it
    kind: EngineKind = KVHARBOR  # how its load is read, what its requests carry, what it can do (engine_kinds.py)
    priority_scheduling: bool = False  # a vLLM engine run with --scheduling-policy priority (--vllm-priority)
    answered_at: float = field(default_factory=time.monotonic)  # its /load's last answer (or when it was added)
    progressed_at: float = field(default_factory=time.monotonic)  # its steps last moved (or it had no work)
    _lost: asyncio.Event | None = field(default=None, repr=False)  # set while it is ejected

    async def lost(self) -> None:
        """Returns once the engine is ejected (at once if it is): a request waiting on it for its
        first token moves to another (gateway/proxy.py)."""
        if self._lost is None:
            self._lost = asyncio.Event()
            if self.ejected:
                self._lost.set()
        await self._lost.wait()

    def _set_lost(self, lost: bool) -> None:
        if self._lost is not None and lost:
            self._lost.set()
        elif self._lost is not None and self._lost.is_set():
            self._lost = None  # back in rotation: a fresh event for the next ejection

    @property
    def routable(self) -> bool:
        return self.polled and not self.ejected and not self.draining

    def send(self, prefill_tokens: int, adapter: str | None = None, prompt_tokens: int = 0) -> Sent:
        """Count a request this gateway sends now (with the prompt tokens it must prefill, its LoRA
        adapter and its whole prompt) until `done`: the load polled before it cannot show it, so
        the router adds it itself."""
        sent = Sent(self, time.monotonic(), prefill_tokens, adapter, prompt_tokens)
        self.sent.add(sent)
        return sent

    def serves_adapter(self, adapter: str) -> bool:
        """Its /load lists this LoRA adapter (by name) among those it can serve."""
        return adapter in self.load.lora_adapters

    @property
    def active_adapters(self) -> frozenset[str]:
        """Adapters in its slots: the polled `lora_active`, plus those of the requests this gateway
        has open there. NOTE: every open request, not only the unseen ones: a request the engine
        queues for a slot is not in `lora_active` yet, but it will swap its adapter in, and the
        next request for that adapter rides on that swap instead of paying another elsewhere."""
        pending = {s.adapter for s in self.sent if s.adapter}
        return frozenset(self.load.lora_active).union(pending)

    @property
    def lora_free_slots(self) -> int:
        """Slots no adapter holds, counting those the open requests of this gateway will take."""
        return max(0, self.load.lora_slots - len(self.active_adapters))

    def _unseen(self) -> list[Sent]:
        """Open requests sent after the last poll (less the time a request takes to reach the
        engine's scheduler): the polled report cannot include them yet."""
        return [s for s in self.sent if s.at > self.polled_at - SEND_LAG_S]

    @property
    def queue(self) -> int:
        """Requests on the engine: the polled count, plus this gateway's sent since."""
        return self.load.queue + len(self._unseen())

    @property
    def kv_free(self) -> float:
        return self.load.kv_free_fraction

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prompt tokens queued there: the polled count, plus those of this gateway's requests sent
        since that have no first token yet."""
        return self.load.waiting_prefill_tokens + sum(s.prefill for s in self._unseen())

    def predicted_itl_s(self, prompt_tokens: int = 0) -> float:
        """The inter-token latency a request of `prompt_tokens` sent now would see: the engine's
        decode step with one more sequence than it runs and queues, over the context its running
        sequences hold, the prompt tokens queued there, this gateway's unseen requests' prompts
        and this one's (engine/decode_fit.py fits both growths)."""
        unseen = sum(s.prompt for s in self._unseen())
        context = self.load.context_tokens + self.load.waiting_prefill_tokens + unseen + prompt_tokens
        return self.load.decode_step_s_at(self.queue + 1, context)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.load.prefill_tokens_per_s

    @property
    def role(self) -> str:
        """P/D: both | prefill | decode, as the engine's /load says."""
        return self.load.role


class EnginePool:
    def __init__(
        self,
        client: httpx.AsyncClient,
        eject_after: int = 3,
        interval: float = 0.5,
        on_change: Callable[[], None] = lambda: None,
        vllm_priority: bool = False,
        stall_timeout: float = 30.0,
    ) -> None:
        self.client = client
        self.eject_after = eject_after
        self.interval = interval
        self.stall_timeout = stall_timeout  # seconds without an answer, or without progress, that eject
        self.vllm_priority = vllm_priority  # vLLM engines take a priority (gateway/config.py vllm_priority)
        self.on_change = on_change  # wakes the admission queue when capacity may have appeared
        self._engines: dict[str, Engine] = {}
        self.ejections = 0

    def set_engines(self, model: str, urls: list[str]) -> None:
        """Make `urls` the engines of `model` (discovery); known ones keep their state. A URL
        written `vllm+http://host:port#instance-id` is a vLLM server (its instance id: the one its
        kv-bridge publishes under)."""
        specs = [parse_engine(u) for u in urls]
        for url, name, instance in specs:
            kind = engine_kind(name)
            priority = kind.priority_by_flag and self.vllm_priority
            engine = Engine(url, model, instance_id=instance, kind=kind, priority_scheduling=priority)
            self._engines.setdefault(url, engine)
        keep = {url for url, _, _ in specs}
        for url in [u for u, e in self._engines.items() if e.model == model and u not in keep]:
            del self._engines[url]

    def all(self, model: str | None = None) -> list[Engine]:
        return [e for e in self._engines.values() if model is None or e.model == model]

    def routable(self, model: str) -> list[Engine]:
        return [e for e in self.all(model) if e.routable]

    # -- health -----------------------------------------------------------------------------------

    def failed(self, engine: Engine, reason: str, hard: bool = False, passive: bool = True) -> None:
        """A call to `engine` failed; `hard` (connection refused) ejects at once. After a failed
        call (passive) the engine stays out for a cool-down even if /load still answers: its
        inference path can fail while its HTTP server looks fine."""
        engine.failures += 1
        if passive:
            engine.cooldown_until = time.monotonic() + COOLDOWN_S
        if not engine.ejected and (hard or engine.failures >= self.eject_after):
            engine.ejected = True
            engine._set_lost(True)
            self.ejections += 1
            log.warning("engine ejected", extra={"engine": engine.url, "reason": reason, "failures": engine.failures})

    def succeeded(self, engine: Engine, from_poll: bool = False) -> None:
        if from_poll and time.monotonic() < engine.cooldown_until:
            return
        engine.failures = 0
        if engine.ejected:
            engine.ejected = False
            engine._set_lost(False)
            log.info("engine healthy again; back in rotation", extra={"engine": engine.url})
            self.on_change()

    async def poll_once(self, engine: Engine) -> None:
        sent_at = time.monotonic()
        try:
            load = await self._read_load(engine)
        except httpx.TimeoutException:
            self._late(engine, sent_at)  # busy, until it has been silent for stall_timeout
            return
        except (httpx.HTTPError, ValueError) as exc:
            why = str(exc)[:200] if isinstance(exc, LoadReportError) else type(exc).__name__  # the reason, not a class
            self.failed(engine, f"/load: {why}", hard=isinstance(exc, httpx.ConnectError), passive=False)
            return
        engine.answered_at = time.monotonic()
        if (stall := self._stall(engine, load, sent_at)) is not None:
            engine.load, engine.polled_at = load, sent_at
            self.failed(engine, stall, hard=True, passive=False)
            return
        engine.load, engine.polled_at = load, sent_at
        engine.instance_id = load.instance_id or engine.instance_id
        engine.draining = load.draining
        first = not engine.polled
        engine.polled = True
        self.succeeded(engine, from_poll=True)
        if first:
            log.info("engine up", extra={"engine": engine.url, "instance_id": engine.instance_id})
        self.on_change()

    def _late(self, engine: Engine, now: float) -> None:
        silent = now - engine.answered_at
        if silent >= self.stall_timeout:
            self.failed(engine, f"stalled: /load unanswered for {silent:.0f} s", hard=True, passive=False)

    def _stall(self, engine: Engine, load: LoadReport, now: float) -> str | None:
        """Why an engine that answered is stalled, or None: its core silent past stall_timeout,
        or its steps still that long while it has requests."""
        if load.core_silent_s >= self.stall_timeout:
            return f"stalled: its engine core silent for {load.core_silent_s:.0f} s"
        moved = load.steps != engine.load.steps or load.queue == 0 or not engine.kind.counts_steps
        if moved or not engine.polled:
            engine.progressed_at = now
            return None
        still = now - engine.progressed_at
        if still >= self.stall_timeout:
            return f"stalled: no engine step in {still:.0f} s with {load.queue} requests"
        return None

    def poll_timeout(self, engine: Engine) -> float:
        """A poll's timeout: short while the engine answers; once it is late, what is left of its
        stall window (at least that short one), so a busy engine's late answer still counts."""
        quick, silent = max(1.0, self.interval * 2), time.monotonic() - engine.answered_at
        return max(quick, self.stall_timeout - silent) if silent > quick else quick

    async def _read_load(self, engine: Engine) -> LoadReport:
        """kvharbor's /load, or a vLLM server's /metrics mapped onto a LoadReport: by the kind
        discovery gave the engine, never guessed from what an answer looks like."""
        return await engine.kind.read_load(self.client, engine, self.poll_timeout(engine))

    async def poll_forever(self) -> None:
        """Poll every engine each `interval`, each on its own: a poll still waiting on a late
        engine is not started again, and holds up no other engine's."""
        polls: dict[str, asyncio.Task] = {}
        try:
            while True:
                started = time.monotonic()
                for engine in list(self._engines.values()):
                    task = polls.get(engine.url)
                    if task is not None and not task.done():
                        continue
                    if task is not None and not task.cancelled() and task.exception() is not None:
                        log.error("engine poll failed unexpectedly", exc_info=task.exception())  # a bug: go on
                    polls[engine.url] = asyncio.create_task(self.poll_once(engine))
                for url in [u for u in polls if u not in self._engines]:
                    polls.pop(url).cancel()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            for task in polls.values():
                task.cancel()


def parse_engine(spec: str) -> tuple[str, str, str | None]:
    """(url, kind, fixed instance id) of an engine address: `http://host:port` is a kvharbor
    engine; `vllm+http://host:port#instance-id` a vLLM server. Raises ValueError otherwise."""
    kind, _, rest = spec.partition("+") if "+" in spec.split("://", 1)[0] else ("kvharbor", "", spec)
    if kind not in KINDS:
        raise ValueError(f"engine kind {kind!r} in {spec!r} is not one of {', '.join(KINDS)}")
    url, _, instance = rest.partition("#")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine address {spec!r} must be http(s)://host:port (vllm+http://...#instance for vLLM)")
    if KINDS[kind].names_instance and not instance:
        raise ValueError(f"a vLLM engine names the instance id its kv-bridge publishes: {spec}#<instance-id>")
    return url.rstrip("/"), kind, instance or None
