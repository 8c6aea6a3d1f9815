"""EventConsumer: the engines' KV event streams, applied to the index exactly once, by several
service replicas at once.

Each engine instance writes its own stream (`kvharbor:kv:{M:I}`) and registers it in
`kvharbor:kv:streams`. The replicas share the streams by consistent hashing:
- every replica heartbeats into a membership set (`kvharbor:idx:intake:members`, scored by
  expiry on Redis's clock) and reads it back, every `rebalance_interval`;
- a stream belongs to the member whose point on the hash ring (64 points per member) follows the
  stream's hash, so a replica joining or dying moves only about 1/N of the streams;
- to consume a stream a replica must also hold its owner key (`kvharbor:idx:{M:I}:own`, PX ttl,
  renewed every round): a replica gives up the streams the ring no longer gives it, and takes a
  stream only once its owner key is free, so two replicas never consume one stream at once.

Taking a stream, a replica first claims the entries still pending in the stream's consumer group
(from any consumer, XAUTOCLAIM) and applies them in order, then reads new ones. Applying is fenced
by the owner key inside the index's per-instance script, and moves the stream's cursor in the same
step, so entries delivered twice are skipped, and a replica that stalled past its ownership
cannot apply the batch it still holds (LeadershipLost). Its cross-slot shard writes are the one
step outside that fence: a replica stops applying a stream `owner_ttl / 3` before its ownership
would lapse without renewal, which bounds that window by the clock. Malformed entries are
acknowledged, skipped and counted. The lowest-named member also sweeps lapsed leases, and checks
that no block shard lost its data: when one did (a cluster node restarted empty), or when Redis
holds an index of another key layout than this build's (an upgrade moved the blocks; checked by
every replica before it first applies), it bumps the resync counter and every engine re-publishes
what it holds.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import hashlib
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

from kvharbor.common.kv_events import MalformedEvent, from_fields
from kvharbor.common.redis_client import Call, Script, SlotPipelines
from kvharbor.common.redis_keys import (
    INDEX_PREFIX,
    STREAM_PREFIX,
    lease_key,
    parse_registry_value,
    resync_key,
    stream_registry_key,
)
from kvharbor.kvcache_service.index import IndexUnavailable, LeadershipLost, StreamEvent
from kvharbor.kvcache_service.layout_migration import LayoutMigration

log = logging.getLogger("kvharbor.kvcache.intake")

# KEYS: members zset. ARGV: me, ttl ms. Heartbeat on Redis's clock; returns the live members.
_MEMBERS = Script(
    """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
)

# KEYS: owner key. ARGV: me, ttl ms. 1 while we own it (renewed or newly taken), 0 if another does.
_TAKE = Script(
    """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if cur then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)

# KEYS: owner key. ARGV: me. Gives the stream up, if it is still ours.
_RELEASE = Script(
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
)

RING_POINTS = 64


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing of stream keys over the live members."""

    def __init__(self, members: list[str], points: int = RING_POINTS) -> None:
        ring = sorted((_point(f"{m}#{k}"), m) for m in members for k in range(points))
        self._points = [p for p, _ in ring]
        self._owners = [m for _, m in ring]

    def owner(self, stream: str) -> str | None:
        if not self._points:
            return None
        i = bisect.bisect(self._points, _point(stream)) % len(self._points)
        return self._owners[i]


@dataclass
class IntakeStats:
    applied: int = 0
    duplicates: int = 0
    malformed: Counter = field(default_factory=Counter)
    acked: int = 0
    claimed: int = 0
    swept: int = 0
    errors: int = 0
    handoffs: int = 0  # streams given up or lost to another replica
    resyncs_requested: int = 0  # times this replica found part of the index lost
    old_layout_removed: int = 0  # keys of an older index layout this replica removed (as leader)
    members: int = 0
    leader: bool = False  # this replica sweeps lapsed leases
    healthy: bool = False
    last_error: str = ""


class EventConsumer:
    def __init__(
        self,
        client,
        index,
        *,
        group: str = "kvharbor-kvcache",
        consumer: str | None = None,
        stream_prefix: str = STREAM_PREFIX,
        members_key: str = INDEX_PREFIX + "intake:members",
        owner_ttl: float = 10.0,
        batch: int = 512,
        poll_ms: int = 50,
        rebalance_interval: float = 1.0,
        sweep_interval: float = 2.0,
    ) -> None:
        # A redis.asyncio client (Redis or RedisCluster) that returns bytes: decoding is
        # from_fields' job, so one bad byte in an entry makes that entry malformed instead of
        # failing the whole read. `index` is a RedisIndex (its owner keys fence the intake).
        self.client = client
        self.index = index
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.stream_prefix = stream_prefix
        self.members_key = members_key
        self.owner_ttl = owner_ttl
        self.batch = batch
        self.poll_ms = poll_ms
        self.rebalance_interval = rebalance_interval
        self.sweep_interval = sweep_interval
        self.stats = IntakeStats()
        self.streams: dict[str, tuple[str, str]] = {}  # streams this replica consumes -> (model, instance)
        self._valid_until: dict[str, float] = {}  # stream -> when our ownership may lapse (monotonic)
        self._registry: dict[str, tuple[str, str]] = {}  # every registered stream -> (model, instance)
        self._marked: set[str] = set()  # models whose shard markers this replica has put or seen
        self._layout_claimed = False  # whether this replica recorded the index layout it writes
        self.layout = LayoutMigration(index)  # the index's key layout across upgrades
        self._slots = SlotPipelines(client)
        self._stopping = asyncio.Event()
        self._next_rebalance = 0.0
        self._next_sweep = 0.0

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until `stop()`. Redis trouble is logged and retried with backoff, never raised."""
        from redis.exceptions import RedisClusterException, RedisError

        backoff = 0.2
        while not self._stopping.is_set():
            try:
                await self.step()
                backoff = 0.2
            except (RedisError, RedisClusterException, OSError, TimeoutError, IndexUnavailable) as exc:
                self._lost(exc)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # a bug must not silently end intake: log, count, retry
                log.exception("KV event intake failed unexpectedly; retrying")
                self._lost(exc)
                await self._sleep(5.0)

    async def step(self) -> None:
        """One round: rebalance when due, read and apply one batch per stream, sweep when due."""
        now = time.monotonic()
        if now >= self._next_rebalance:
            await self._rebalance()
            self._next_rebalance = now + self.rebalance_interval
        if not self._layout_claimed:
            await self._claim_layout()
        got = await self._read_new() if self.streams else 0
        if self.stats.leader and time.monotonic() >= self._next_sweep:
            await self._sweep()
            self._next_sweep = time.monotonic() + self.sweep_interval
        self.stats.healthy = True
        if not got:
            await self._sleep(self.poll_ms / 1000)

    def _lost(self, exc: BaseException) -> None:
        if self.stats.healthy or not self.stats.last_error:
            log.warning("KV event intake interrupted; retrying", extra={"error": repr(exc)})
        self.stats.errors += 1
        self.stats.healthy = False
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        # Pending entries are claimed again before new ones are read, once ownership is renewed.
        self.streams.clear()
        self._valid_until.clear()
        self._next_rebalance = 0.0

    async def stop(self) -> None:
        """Stop, and hand every stream back at once (the others need not wait for a TTL)."""
        self._stopping.set()
        with contextlib.suppress(Exception):
            owned = [self._owner_key(s) for s in self.streams]
            await self._slots.run([Call(k, (self.consumer,), _RELEASE, (k,)) for k in owned])
            await self.client.zrem(self.members_key, self.consumer)
        self.streams.clear()
        await self.layout.drop_pass()
        await self._slots.close()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- ownership --------------------------------------------------------------------------------

    def _owner_key(self, stream: str) -> str:
        model, instance = self.streams.get(stream) or self._registry[stream]
        return self.index.own_key(model, instance)

    async def _rebalance(self) -> None:
        ttl_ms = int(self.owner_ttl * 1000)
        (members,) = await self._slots.run(
            [Call(self.members_key, (self.consumer, ttl_ms), _MEMBERS, (self.members_key,))]
        )
        members = sorted(_text(m) for m in members)
        self.stats.members = len(members)
        self.stats.leader = bool(members) and members[0] == self.consumer
        registry = await self.client.hgetall(stream_registry_key(self.stream_prefix))
        self._registry = {_text(k): parse_registry_value(v) for k, v in registry.items()}
        ring = Ring(members)
        mine = {s for s in self._registry if ring.owner(s) == self.consumer}
        for stream in [s for s in self.streams if s not in mine]:
            await self._give_up(stream, "the ring gave it to another replica")
        started = time.monotonic()
        wanted = sorted(mine)
        keys = [self.index.own_key(*self._registry[s]) for s in wanted]
        held = await self._slots.run([Call(k, (self.consumer, ttl_ms), _TAKE, (k,)) for k in keys])
        for stream, ok in zip(wanted, held, strict=True):
            if not int(ok):
                if stream in self.streams:
                    self._drop(stream, "its owner key is held by another replica")
                continue
            self._valid_until[stream] = started + self.owner_ttl * 2 / 3
            if stream not in self.streams:
                await self._take(stream)

    async def _give_up(self, stream: str, why: str) -> None:
        key = self._owner_key(stream)
        self._drop(stream, why)
        await self._slots.run([Call(key, (self.consumer,), _RELEASE, (key,))])

    def _drop(self, stream: str, why: str) -> None:
        log.info("stopped consuming a KV event stream", extra={"stream": stream, "why": why})
        self.streams.pop(stream, None)
        self._valid_until.pop(stream, None)
        self.stats.handoffs += 1

    async def _take(self, stream: str) -> None:
        from redis.exceptions import ResponseError

        try:
            await self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            log.info("consuming KV events", extra={"stream": stream, "group": self.group})
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.streams[stream] = self._registry[stream]
        await self._claim_pending(stream)

    async def _claim_pending(self, stream: str) -> None:
        start = "0-0"
        while stream in self.streams:
            reply = await self.client.xautoclaim(stream, self.group, self.consumer, 0, start, count=self.batch)
            start, entries = _text(reply[0]), reply[1]
            if entries:
                self.stats.claimed += len(entries)
                await self._process({stream: entries})
            if start == "0-0":
                return

    # -- reading ----------------------------------------------------------------------------------

    async def _read_new(self) -> int:
        from redis.exceptions import ResponseError

        now = time.monotonic()
        for stream in [s for s, until in self._valid_until.items() if until <= now and s in self.streams]:
            self._drop(stream, "its ownership was not renewed in time")  # taken again when renewed
        streams = sorted(self.streams)
        calls = [
            Call(s, ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", self.batch, "STREAMS", s, ">"))
            for s in streams
        ]
        replies = await self._slots.run(calls, raise_on_error=False)
        entries: dict[str, list] = {}
        for stream, reply in zip(streams, replies, strict=True):
            if isinstance(reply, ResponseError):
                if "NOGROUP" not in str(reply):
                    raise reply
                # The stream was deleted or Redis restarted empty: take it again next round.
                self._drop(stream, "it lost its consumer group")
                continue
            for _name, items in (reply.items() if isinstance(reply, dict) else reply or []):
                if items:  # raw entries: [id, [field, value, ...]] (a trimmed entry has none)
                    entries[stream] = items
        if entries:
            await self._process(entries)
        return sum(len(items) for items in entries.values())

    async def _process(self, entries: dict[str, list]) -> None:
        with _gc_paused():
            await self._apply_and_ack(entries)

    async def _apply_and_ack(self, entries: dict[str, list]) -> None:
        good: list[StreamEvent] = []
        ids: dict[str, list[str]] = {}
        for stream, items in entries.items():
            model, instance = self.streams[stream]
            ids[stream] = []
            for raw_id, fields in items:
                entry_id = _text(raw_id)
                ids[stream].append(entry_id)
                try:
                    good.append(StreamEvent(_parse(fields, model, instance), stream, entry_id))
                except MalformedEvent as exc:
                    self._malformed(stream, entry_id, exc)
        lost: frozenset = frozenset()
        try:
            applied = await self.index.apply(good, fence=self.consumer) if good else 0
        except LeadershipLost as exc:
            applied, lost = exc.applied, exc.lost
        lost_streams = {s for s in entries if self.streams.get(s) in lost}
        for stream in lost_streams:
            self._drop(stream, "another replica owns it now")  # its entries stay pending for that one
        self.stats.applied += applied
        self.stats.duplicates += sum(1 for e in good if e.stream not in lost_streams) - applied
        acks = [Call(s, ("XACK", s, self.group, *ids[s])) for s in entries if s not in lost_streams and ids[s]]
        await self._slots.run(acks)
        self.stats.acked += sum(len(ids[s]) for s in entries if s not in lost_streams)

    def _malformed(self, stream: str, entry_id: str, exc: MalformedEvent) -> None:
        reason = _reason(exc)
        self.stats.malformed[reason] += 1
        log.warning(
            "skipped a malformed KV event",
            extra={"stream": stream, "entry": entry_id, "reason": reason, "error": str(exc)},
        )

    # -- sweeping ---------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        await self._check_shards()
        swept = await self.index.expire()
        for model, instance in swept:
            log.info("instance lease expired; its KV entries were swept", extra={"model": model, "instance": instance})
        self.stats.swept += len(swept)
        await self._unregister(swept)
        await self._remove_old_layout()

    async def _remove_old_layout(self) -> None:
        """The leader's few SCAN calls a sweep over an older layout's keys (layout_migration.py)."""
        try:
            await self.layout.sweep()
        finally:
            self.stats.old_layout_removed = self.layout.removed_total

    async def _check_shards(self) -> None:
        """Ask every engine to re-sync when a block shard of a model this replica had marked
        lost its marker: a cluster node came back empty, and engines whose own keys live on other
        nodes would never notice that the index forgot their blocks."""
        models = {model for model, _ in self._registry.values()} | self._marked
        if not models:
            return
        missing = await self.index.mark_shards(sorted(models))
        lost = missing & self._marked
        if lost:
            log.warning("part of the KV index was lost; asking every engine to re-sync", extra={"models": sorted(lost)})
            await self._request_resync()
        self._marked |= models

    async def _claim_layout(self) -> None:
        """Before this replica applies anything: name the index's key layout, and ask every engine
        to re-sync if Redis holds an index in another one (blocks this build cannot read)."""
        if await self.layout.claim():
            log.warning("the KV index in Redis has another key layout; asking every engine to re-sync")
            await self._request_resync()
        self._layout_claimed = True

    async def _request_resync(self) -> None:
        await self.client.incr(resync_key(self.stream_prefix))
        self.stats.resyncs_requested += 1

    async def _unregister(self, swept: list[tuple[str, str]]) -> None:
        """Swept instances' streams leave the registry, unless the engine came back meanwhile
        (it registers again on every re-sync anyway)."""
        if not swept:
            return
        keys = [lease_key(m, i) for m, i in swept]
        alive = await self._slots.run([Call(k, ("EXISTS", k)) for k in keys])
        registry = stream_registry_key(self.stream_prefix)
        back = {pair for pair, hit in zip(swept, alive, strict=True) if int(hit)}
        dead = set(swept) - back
        gone = [s for s, pair in self._registry.items() if pair in dead]
        if gone:
            await self.client.hdel(registry, *gone)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic collector off for one batch. A batch keeps every event it parsed alive
    (hundreds of thousands at a thousand streams), so the collections its allocations triggered
    kept traversing them: 10 us of the intake's ~28 us of Python an event, measured at 1,000
    engines on a 2-core EPYC (25k -> 34k events/s, one replica). The switch is the process's:
    whatever else runs in its event loop meanwhile (the service's lookups) runs without the
    collector too. Nothing is lost: cycles made meanwhile are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _parse(fields: dict | list, model: str, instance: str):
    if not fields:
        raise MalformedEvent("entry was trimmed from the stream before it was read")
    envelope = from_fields(fields)
    if envelope.model != model:
        raise MalformedEvent(f"event for model {envelope.model!r} on the stream of {model!r}")
    if envelope.instance != instance:
        raise MalformedEvent(f"event for model instance {envelope.instance!r} on the stream of {instance!r}")
    return envelope


def _text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _reason(exc: MalformedEvent) -> str:
    text = str(exc)
    for needle, reason in (
        ("version", "version"),
        ("unknown event type", "type"),
        ("trimmed", "trimmed"),
        ("model instance", "instance"),
        ("for model", "model"),
    ):
        if needle in text:
            return reason
    return "invalid"
