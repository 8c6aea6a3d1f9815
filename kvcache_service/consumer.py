"""EventConsumer: the engines' KV event streams, applied to the index exactly once.

Intake runs through one Redis consumer group per stream. Exactly one service replica consumes at a
time (it holds the intake lock; the others serve lookups), because a stream's events must be applied
in order. When a replica becomes the consumer (start-up, restart, lock taken over, Redis back) it
first claims every entry still pending in the group, from any consumer, in stream order, and applies
them before it reads new ones. Applying moves the index's per-stream cursor in the same atomic step,
so entries delivered twice (applied, then the consumer died before XACK) are skipped: nothing is
lost, nothing is applied twice. The apply is fenced by the intake lock: a consumer that lost the
lock while it stalled cannot apply the batch it still holds (LeadershipLost), so it cannot move
the cursor past entries the new consumer has not applied yet. Malformed entries are acknowledged, skipped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

from kvharbor.common.kv_events import MalformedEvent, from_fields
from kvharbor.common.redis_keys import INDEX_PREFIX, STREAM_PREFIX, model_from_stream
from kvharbor.kvcache_service.index import Index, IndexUnavailable, LeadershipLost, StreamEvent

log = logging.getLogger("kvharbor.kvcache.intake")

_RENEW_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class IntakeStats:
    applied: int = 0
    duplicates: int = 0
    malformed: Counter = field(default_factory=Counter)
    acked: int = 0
    claimed: int = 0
    swept: int = 0
    errors: int = 0
    leader: bool = False
    healthy: bool = False
    last_error: str = ""


class EventConsumer:
    def __init__(
        self,
        client,
        index: Index,
        *,
        group: str = "kvharbor-kvcache",
        consumer: str | None = None,
        stream_prefix: str = STREAM_PREFIX,
        lock_key: str = INDEX_PREFIX + "intake-lock",
        lock_ttl: float = 10.0,
        batch: int = 512,
        block_ms: int = 500,
        discover_interval: float = 2.0,
        sweep_interval: float = 2.0,
    ) -> None:
        # A redis.asyncio client that returns bytes: decoding is from_fields' job, so one bad
        # byte in an entry makes that entry malformed instead of failing the whole read.
        self.client = client
        self.index = index
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.stream_prefix = stream_prefix
        self.lock_key = lock_key
        self.lock_ttl = lock_ttl
        self.batch = batch
        self.block_ms = block_ms
        self.discover_interval = discover_interval
        self.sweep_interval = sweep_interval
        self.stats = IntakeStats()
        self.streams: set[str] = set()  # streams whose pending entries were claimed by this leader
        self._renew = client.register_script(_RENEW_LOCK)
        self._stopping = asyncio.Event()
        self._next_discover = 0.0
        self._next_sweep = 0.0

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until `stop()`. Redis trouble is logged and retried with backoff, never raised."""
        from redis.exceptions import RedisError

        backoff = 0.2
        while not self._stopping.is_set():
            try:
                await self.step()
                backoff = 0.2
            except (RedisError, OSError, TimeoutError, IndexUnavailable, LeadershipLost) as exc:
                self._lost(exc)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # a bug must not silently end intake: log, count, retry
                log.exception("KV event intake failed unexpectedly; retrying")
                self._lost(exc)
                await self._sleep(5.0)

    async def step(self) -> None:
        """One round: keep the lock, find streams, read and apply one batch, sweep dead leases."""
        if not await self._lead():
            self.stats.healthy = True
            await self._sleep(self.lock_ttl / 3)
            return
        now = time.monotonic()
        if now >= self._next_discover:
            await self._discover()
            self._next_discover = now + self.discover_interval
        if self.streams:
            await self._read_new()
        else:
            await self._sleep(self.block_ms / 1000)
        if time.monotonic() >= self._next_sweep:
            await self._sweep()
            self._next_sweep = time.monotonic() + self.sweep_interval
        self.stats.healthy = True

    def _lost(self, exc: BaseException) -> None:
        if self.stats.healthy or not self.stats.last_error:
            log.warning("KV event intake interrupted; retrying", extra={"error": repr(exc)})
        self.stats.errors += 1
        self.stats.healthy = False
        self.stats.leader = False
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        self.streams.clear()  # pending entries are claimed again before new ones are read

    async def stop(self) -> None:
        self._stopping.set()
        if self.stats.leader:
            with contextlib.suppress(Exception):
                if _text(await self.client.get(self.lock_key)) == self.consumer:
                    await self.client.delete(self.lock_key)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- leadership -------------------------------------------------------------------------------

    async def _lead(self) -> bool:
        held = bool(await self._renew(keys=[self.lock_key], args=[self.consumer, int(self.lock_ttl * 1000)]))
        if held != self.stats.leader:
            log.info("intake leadership %s", "taken" if held else "lost", extra={"consumer": self.consumer})
            self.streams.clear()
        self.stats.leader = held
        return held

    # -- streams ----------------------------------------------------------------------------------

    async def _discover(self) -> None:
        from redis.exceptions import ResponseError

        async for raw in self.client.scan_iter(match=self.stream_prefix + "*", _type="stream", count=500):
            key = _text(raw)
            if key in self.streams:
                continue
            try:
                await self.client.xgroup_create(key, self.group, id="0")
                log.info("consuming KV events", extra={"stream": key, "group": self.group})
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            await self._claim_pending(key)
            self.streams.add(key)

    async def _claim_pending(self, stream: str) -> None:
        start = "0-0"
        while True:
            reply = await self.client.xautoclaim(stream, self.group, self.consumer, 0, start, count=self.batch)
            start, entries = _text(reply[0]), reply[1]
            if entries:
                self.stats.claimed += len(entries)
                await self._process(stream, entries)
            if start == "0-0":
                return

    async def _read_new(self) -> None:
        from redis.exceptions import ResponseError

        try:
            reply = await self.client.xreadgroup(
                self.group, self.consumer, {s: ">" for s in self.streams}, count=self.batch, block=self.block_ms
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # A stream was deleted or Redis restarted empty: find the streams again.
            log.info("a KV event stream lost its group; rediscovering", extra={"error": str(exc)})
            self.streams.clear()
            self._next_discover = 0.0
            return
        for stream, entries in reply or []:
            await self._process(_text(stream), entries)

    async def _process(self, stream: str, entries: list) -> None:
        model = model_from_stream(stream, self.stream_prefix)
        good: list[StreamEvent] = []
        entries = [(_text(entry_id), fields) for entry_id, fields in entries]
        for entry_id, fields in entries:
            try:
                if not fields:
                    raise MalformedEvent("entry was trimmed from the stream before it was read")
                envelope = from_fields(fields)
                if envelope.model != model:
                    raise MalformedEvent(f"event for model {envelope.model!r} on the stream of {model!r}")
                good.append(StreamEvent(envelope, stream, entry_id))
            except MalformedEvent as exc:
                reason = _reason(exc)
                self.stats.malformed[reason] += 1
                log.warning(
                    "skipped a malformed KV event",
                    extra={"stream": stream, "entry": entry_id, "reason": reason, "error": str(exc)},
                )
        applied = await self.index.apply(good, fence=(self.lock_key, self.consumer)) if good else 0
        self.stats.applied += applied
        self.stats.duplicates += len(good) - applied
        await self.client.xack(stream, self.group, *[entry_id for entry_id, _ in entries])
        self.stats.acked += len(entries)

    async def _sweep(self) -> None:
        swept = await self.index.expire()
        for model, instance in swept:
            log.info("instance lease expired; its KV entries were swept", extra={"model": model, "instance": instance})
        self.stats.swept += len(swept)


def _text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _reason(exc: MalformedEvent) -> str:
    text = str(exc)
    for needle, reason in (
        ("version", "version"),
        ("unknown event type", "type"),
        ("trimmed", "trimmed"),
        ("for model", "model"),
    ):
        if needle in text:
            return reason
    return "invalid"
