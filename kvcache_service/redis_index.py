"""RedisIndex: the `Index` contract kept in Redis or a Redis Cluster, shared by every gateway and
KV cache service replica. The same code runs on both (common/redis_client.py picks the client).

Layout (P = kvharbor:idx:, M = model, I = instance; tags from common/redis_keys.py):

    P{M:<t><NN>}:b2:<bucket> HASH 16-byte block hash -> the 8-byte holder ids that hold it
                             (tier t, shard NN = first hash byte % SHARDS, bucket from bytes 2-3)
    P{M:<t><NN>}:b2:m        a marker: gone means the shard's node lost its data
    P{M:I}:st                HASH lease + holder of the applied events, block count per tier,
                             cursor:<stream> (last applied entry of each stream)
    P{M:I}:log:<t>           the instance's stored/removed hashes in order (op, count, hashes)
    P{M:I}:pend              HASH shard records written but maybe not yet applied (write-ahead)
    P{M:I}:own               intake owner of the instance's stream (the fence), PX ttl
    P{M}:holders             HASH holder id -> "I\\nlease", to name the holders a lookup finds
    P models, P block_size, P instances   small global keys
    P layout, P layout:old   the shard key layout, and a mark while keys of an older one remain
                             (kvcache_service/layout_migration.py)

Why block -> holders: a lookup reads the prompt's blocks, not the instances. On a single Redis one
script reads the chain in order and stops at the first block nobody holds; on a cluster one script
per shard touched (at most SHARDS, whatever the fleet size). It walks the chain once and stops
counting a holder at its first missing block, so it costs O(blocks + holders of the prompt), and
engines that hold none of it cost nothing. The holders' lease keys are read as well, at most every
LIVENESS_CACHE_S. A holder id is blake2b(instance, lease): a new life of an instance is another
holder, so a late entry of the old life never counts for the new one.

Memory per (block, instance) entry: 8 bytes of holder id in the block's field (the field's own
~30 bytes in a compact bucket are shared by every holder of the block) plus 16 bytes in the
instance's log, which `cleared`, a new lease, a sweep and `forget` read to know what to remove.

Applying one instance's events spans slots (its own keys, and the block shards), so it runs in
three steps, each atomic on its slot:
  A. one script on the instance's slot: checks the fence (`own`), skips entries at or before the
     stream's cursor and events of another life, appends to the log, moves the cursor, and
     writes the shard records it implies to `pend` (a write-ahead record) before returning them;
  B. one script per block shard applies them (add a holder if absent, remove it if present) and
     says how many blocks each record added or removed;
  C. `pend` is deleted (only if it is still the record A wrote), and the instance's block count
     moves by what B said.
A consumer that dies between A and C leaves `pend` behind; whoever touches the instance next (A
answers "pending") replays it first. B's ops for one (block, holder) pair all sit in one shard
script, so replaying a record, once or twice, leaves the same state as applying it once: nothing
is lost and nothing counts twice. Any Redis failure or timeout raises `IndexUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope, Tier
from kvharbor.common.redis_client import Call, Script, SlotPipelines, connect, pairs
from kvharbor.common.redis_keys import (
    INDEX_PREFIX,
    LEASE_PREFIX,
    index_instance_key,
    index_model_key,
    index_shard_key,
    lease_key,
    parse_registry_value,
    registry_value,
)
from kvharbor.kvcache_service.index import (
    FORGET_TTL_S,
    FORGOTTEN,
    IndexUnavailable,
    InstanceInfo,
    LeadershipLost,
    StreamEvent,
    joined_chain,
)
from kvharbor.kvcache_service.index_scripts import APPLY, DONE, DROP, READ, SHARD, SHARDS

log = logging.getLogger("kvharbor.kvcache.index")

TIER_LETTER = {"device": "d", "shared": "s"}
HOLDER_BYTES = 8
# A lookup re-reads a holder's lease key at most this often (in the background for readings up
# to twice as old): no second round trip on most lookups, for an engine that dies dropping out
# of lookups up to twice this later than its lease.
LIVENESS_CACHE_S = 0.25
REGISTRY_REFRESH_S = 5.0
HASH_BYTES = 16
_UNSEEN = (None, 0.0)  # the lease reading of an instance never read: no lease, stale

@functools.lru_cache(maxsize=65536)  # asked for every event; a fleet has few (instance, lease) pairs
def holder_id(instance: str, lease: str) -> bytes:
    """The id one life (instance, lease) of an engine holds blocks under."""
    return hashlib.blake2b(f"{instance}\n{lease}".encode(), digest_size=HOLDER_BYTES).digest()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class RedisIndex:
    """`Index` on Redis. `client` is a redis.asyncio Redis or RedisCluster client returning
    bytes; its timeouts bound every call."""

    def __init__(
        self,
        client,
        prefix: str = INDEX_PREFIX,
        lease_prefix: str = LEASE_PREFIX,
        liveness_cache_s: float = LIVENESS_CACHE_S,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._lease_prefix = lease_prefix
        self._slots = SlotPipelines(client)
        self._names: dict[str, dict[bytes, tuple[str, str]]] = {}  # model -> holder id -> (instance, lease)
        self._liveness_cache_s = liveness_cache_s
        self._written: dict[tuple, float] = {}  # registry writes -> when to send them again
        self._refreshing: asyncio.Future | None = None  # a background lease read, while one runs
        # model -> instance -> (the lease its key held or None, read until)
        self._leases_seen: dict[str, dict[str, tuple[str | None, float]]] = {}

    @classmethod
    def from_url(cls, url: str, timeout: float = 1.0, **kwargs) -> RedisIndex:
        return cls(connect(url, timeout=timeout), **kwargs)

    # -- what the layout migration reads (kvcache_service/layout_migration.py) ---------------------

    @property
    def client(self):
        return self._client

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def cluster(self) -> bool:
        return self._slots.cluster

    def global_key(self, name: str) -> str:
        return self._global(name)

    async def run(self, calls: list[Call]) -> list:
        """Calls grouped by slot, in one round trip per node (IndexUnavailable on any failure)."""
        return await self._run(calls)

    # -- keys ---------------------------------------------------------------------------------

    def _instance_keys(self, model: str, instance: str) -> tuple[str, ...]:
        """st, pend, own, lease, then the block logs of tier d and of tier s: one slot."""
        key = lambda part: index_instance_key(model, instance, part, self._prefix)  # noqa: E731
        lease = lease_key(model, instance, self._lease_prefix)
        return key("st"), key("pend"), key("own"), lease, key("log:d"), key("log:s")

    def _shard_call(self, script: Script, model: str, t: str, shard: int, args: Sequence[bytes]) -> Call:
        anchor = index_shard_key(model, t, shard, self._prefix)
        return Call(anchor, (anchor + ":", *args), script, (anchor,))

    def own_key(self, model: str, instance: str) -> str:
        """The key whose value names the intake owner of this instance's stream (the fence)."""
        return index_instance_key(model, instance, "own", self._prefix)

    def _global(self, name: str) -> str:
        return self._prefix + name

    async def _run(self, calls: list[Call]) -> list:
        from redis.exceptions import RedisClusterException, RedisError

        try:
            return await self._slots.run(calls)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            raise IndexUnavailable(f"KV index in Redis unavailable: {type(exc).__name__}: {exc}") from exc

    # -- applying -------------------------------------------------------------------------------

    async def apply(self, events: Sequence[EventEnvelope | StreamEvent], fence: str | None = None) -> int:
        """`fence`: the intake consumer's name; each instance's events apply only while its
        stream's owner key names it (LeadershipLost otherwise, for the first instance found)."""
        batches = _group_by_instance(events)
        if not batches:
            return 0
        calls = []
        for (model, instance, stream), batch in batches.items():
            args: list = [uuid.uuid4().hex, stream, fence or ""]
            for entry_id, env in batch:
                args += _event_args(entry_id, env)
            keys = self._instance_keys(model, instance)
            calls.append(Call(keys[0], tuple(args), APPLY, keys))
        replies = await self._run(calls)
        applied, pending, lost = 0, [], []
        for (model, instance, _), reply in zip(batches, replies, strict=True):
            code = int(reply[0])
            if code == -1:
                lost.append((model, instance))
            elif code == -2:
                pending.append((model, instance))
            else:
                applied += code
        await self._finish(batches, calls, replies)
        if pending:
            # A consumer died between writing a pending record and finishing it: replay, retry.
            for model, instance in pending:
                await self.replay_pending(model, instance)
            retry = [e for e in events if _instance_of(e) in pending]
            try:
                applied += await self.apply(retry, fence)
            except LeadershipLost as exc:
                lost += exc.lost
                applied += exc.applied
        if lost:
            names = ", ".join(f"{m}/{i}" for m, i in lost)
            raise LeadershipLost(f"{names}: owned by another consumer than {fence!r}", frozenset(lost), applied)
        return applied

    async def _finish(self, batches: dict, calls: list[Call], replies: list) -> None:
        """Steps B and C for every instance whose step A went through."""
        shipped: list[tuple[str, Call, list[bytes]]] = []
        extra: list[Call] = []
        for (model, instance, stream), call, reply in zip(batches, calls, replies, strict=True):
            if int(reply[0]) < 0:
                continue
            shipped.append((model, call, reply[2:]))
            extra += self._registry_calls(model, instance, batches[(model, instance, stream)], reply[1])
        await self._ship(shipped, extra)

    async def _ship(
        self, shipped: list[tuple[str, Call, list[bytes]]], extra: Sequence[Call] = (), count: bool = True
    ) -> None:
        """Send records (op, tier, holder, hashes) to their block shards, split in order, one call
        per shard; then close each instance's pending record with the blocks it gained (step C)."""
        per: dict[tuple[str, str, int], tuple[list[bytes], list[tuple[int, int]]]] = {}
        for owner, (model, _call, records) in enumerate(shipped):
            for rec in records:
                head, t, body = rec[:1] + rec[2:10], chr(rec[1]), memoryview(rec)[10:]
                if len(body) == HASH_BYTES:  # one block (most events): no split
                    args, owners = per.setdefault((model, t, body[0] % SHARDS), ([], []))
                    args.append(head + body)
                    owners.append((owner, 0 if t == "d" else 1))
                    continue
                parts: dict[int, list] = {}
                for k in range(0, len(body), HASH_BYTES):
                    h = body[k : k + HASH_BYTES]
                    parts.setdefault(h[0] % SHARDS, [head]).append(h)
                for shard, chunk in parts.items():
                    args, owners = per.setdefault((model, t, shard), ([], []))
                    args.append(b"".join(chunk))
                    owners.append((owner, 0 if t == "d" else 1))
        shard_calls = [self._shard_call(SHARD, m, t, shard, args) for (m, t, shard), (args, _) in per.items()]
        replies = await self._run(shard_calls + list(extra))
        gained = [[0, 0] for _ in shipped]
        for (_args, owners), changed in zip(per.values(), replies, strict=False):
            for (owner, tier), n in zip(owners, changed, strict=True):
                gained[owner][tier] += int(n)
        done = []
        for (_model, call, records), (d, s) in zip(shipped, gained, strict=True):
            if records:
                pend, st = call.keys[1], call.keys[0]
                d, s = (d, s) if count else (0, 0)  # a dropped instance has no count left to move
                done.append(Call(pend, (call.args[0], d, s), DONE, (pend, st)))
        await self._run(done)

    def _registry_calls(self, model: str, instance: str, batch: list, dropped: bytes) -> list[Call]:
        """The model-level and global records a batch implies. They are idempotent; each is sent
        again at most every REGISTRY_REFRESH_S by this process (at a thousand engines, four
        writes per instance per round were most of the intake's commands), so a node that lost
        them has them back within that time."""
        holders = index_model_key(model, "holders", self._prefix)
        wanted = [
            Call(self._global("models"), ("SADD", self._global("models"), model)),
            Call(self._global("instances"), ("HSET", self._global("instances"), registry_value(model, instance), 1)),
        ]
        for lease in {env.lease for _, env in batch}:
            wanted.append(Call(holders, ("HSET", holders, holder_id(instance, lease), f"{instance}\n{lease}")))
        for size in {env.event.block_size for _, env in batch if isinstance(env.event, BlockStored)}:
            wanted.append(Call(self._global("block_size"), ("HSET", self._global("block_size"), model, size)))
        now = time.monotonic()
        if len(self._written) > 100_000:
            self._written.clear()
        calls = [c for c in wanted if self._written.get(c.args, 0.0) <= now]
        for call in calls:
            self._written[call.args] = now + REGISTRY_REFRESH_S
        if dropped:
            calls.append(Call(holders, ("HDEL", holders, dropped)))
            self._written = {k: v for k, v in self._written.items() if dropped not in k}
        return calls

    async def replay_pending(self, model: str, instance: str) -> bool:
        """Finish a pending record another consumer left (steps B and C); False if none."""
        pend = self._instance_keys(model, instance)[1]
        (reply,) = await self._run([Call(pend, ("HGETALL", pend))])
        record = pairs(reply)
        if not record:
            return False
        token = record.pop(b"token", b"")
        records = [record[field] for field in sorted(record)]  # e00000001, e00000002, ...: their order
        keys = self._instance_keys(model, instance)
        await self._ship([(model, Call(keys[0], (token,), APPLY, keys), records)])
        return True

    async def _drop(self, model: str, instances: Sequence[str], mode: str, ttl: float = 0.0) -> list[str]:
        """Sweep (lease lapsed) or forget instances: their entries go; returns those dropped."""
        calls = []
        for instance in instances:
            keys = self._instance_keys(model, instance)
            args = (uuid.uuid4().hex, mode, FORGOTTEN, max(1, int(ttl * 1000)))
            calls.append(Call(keys[0], args, DROP, keys))
        replies = await self._run(calls)
        retry, shipped, extra, dropped = [], [], [], []
        for instance, call, reply in zip(instances, calls, replies, strict=True):
            code = int(reply[0])
            if code == -2:
                retry.append(instance)
                continue
            if code == 1:
                dropped.append(instance)
                registered = self._global("instances")
                extra.append(Call(registered, ("HDEL", registered, registry_value(model, instance))))
                if reply[1]:
                    holders = index_model_key(model, "holders", self._prefix)
                    extra.append(Call(holders, ("HDEL", holders, reply[1])))
                    self._written = {k: v for k, v in self._written.items() if reply[1] not in k}
            shipped.append((model, call, reply[2:]))
        await self._ship(shipped, extra, count=False)
        for instance in retry:
            await self.replay_pending(model, instance)
        if retry:
            dropped += await self._drop(model, retry, mode, ttl)
        return dropped

    # -- reading --------------------------------------------------------------------------------

    async def lookup(
        self,
        model: str,
        block_hashes: Sequence[BlockHash],
        instances: Sequence[str] | None = None,
        tier: Tier = "device",
    ) -> dict[str, int]:
        """Alive instances holding the chain's first block, with how many blocks they hold
        consecutively from it. Instances that hold none are absent (they count 0)."""
        if not block_hashes or (instances is not None and not instances):
            return {}
        counts = _walk(*await self._read_blocks(model, TIER_LETTER[tier], block_hashes))
        if not counts:
            return {}
        names = await self._names_of(model, counts)
        wanted = set(instances) if instances is not None else None
        named = [(name, n) for h, n in counts.items() if (name := names.get(h)) and (not wanted or name[0] in wanted)]
        seen = await self._alive(model, [inst for (inst, _), _ in named])
        return {inst: n for (inst, lease), n in named if seen.get(inst, _UNSEEN)[0] == lease}

    async def _read_blocks(self, model: str, t: str, hashes: Sequence[BlockHash]) -> tuple[list[Run], int]:
        """The chain's holders as runs (see `_walk`), and how many blocks were read. On a single
        Redis one script reads the chain in order and stops at the first block nobody holds; on a
        cluster one script per shard (a slot each) reads all of its blocks, nodes in parallel."""
        anchors = [index_shard_key(model, t, shard, self._prefix) for shard in range(SHARDS)]
        chain = joined_chain(hashes)
        if not self._slots.cluster:
            (reply,) = await self._run([Call(anchors[0], ("1", chain), READ, tuple(anchors))])
            return _runs(reply)
        by_shard: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            by_shard.setdefault(h[0] % SHARDS, []).append(i)
        calls = []
        for shard, idx in by_shard.items():
            args = ("0", b"".join(hashes[i] for i in idx))
            calls.append(Call(anchors[shard], args, READ, (anchors[shard],)))
        values = [b""] * len(hashes)
        for idx, reply in zip(by_shard.values(), await self._run(calls), strict=True):
            runs, read = _runs(reply)
            ends = [start for start, _ in runs[1:]] + [read]
            for (start, value), end in zip(runs, ends, strict=True):
                for k in range(start, end):
                    values[idx[k]] = value
        return _compressed(values), len(values)

    async def _names_of(self, model: str, holders: Iterable[bytes]) -> dict[bytes, tuple[str, str]]:
        """The model's holder id -> (instance, lease) cache, with `holders` read into it where it
        lacked them (a holder absent from Redis stays absent)."""
        names = self._names.setdefault(model, {})
        missing = [h for h in holders if h not in names]
        if missing:
            key = index_model_key(model, "holders", self._prefix)
            (reply,) = await self._run([Call(key, ("HMGET", key, *missing))])
            if len(names) > 100_000:
                names.clear()  # holder ids never change meaning: forgetting only costs a read
            for h, value in zip(missing, reply, strict=True):
                if value is not None:
                    names[h] = parse_registry_value(value)
        return names

    async def _alive(self, model: str, instances: list[str]) -> dict[str, tuple[str | None, float]]:
        """The model's instance -> (the lease its lease key holds or None, read until) readings,
        fresh enough for `instances`: a reading up to `liveness_cache_s` old is used as is; up to
        twice that, it is used while a fresh one is read in the background; older, or never
        read, it is read now."""
        now = time.monotonic()
        seen = self._leases_seen.setdefault(model, {})
        unknown, aging = [], []
        for inst in instances:
            until = seen.get(inst, _UNSEEN)[1]
            if until + self._liveness_cache_s <= now:
                unknown.append(inst)
            elif until <= now:
                aging.append(inst)
        if unknown:
            await self._read_leases(model, unknown)
        if aging and self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read_leases(model, aging))
            self._refreshing.add_done_callback(self._refreshed)
        return seen

    async def _read_leases(self, model: str, instances: list[str]) -> None:
        keys = [lease_key(model, inst, self._lease_prefix) for inst in instances]
        if self._slots.cluster:  # each instance has a slot of its own: one GET each, nodes in parallel
            replies = await self._run([Call(k, ("GET", k)) for k in keys])
        else:
            (replies,) = await self._run([Call(keys[0], ("MGET", *keys))])
        seen = self._leases_seen.setdefault(model, {})
        if len(seen) > 100_000:
            seen.clear()
        until = time.monotonic() + self._liveness_cache_s
        for inst, value in zip(instances, replies, strict=True):
            seen[inst] = (_text(value) if value is not None else None, until)

    def _refreshed(self, task: asyncio.Future) -> None:
        self._refreshing = None
        if not task.cancelled() and task.exception() is not None:
            log.debug("background lease read failed", extra={"error": repr(task.exception())})

    async def renew(self, model: str, instance: str, lease: str, ttl: float) -> None:
        self._leases_seen.get(model, {}).pop(instance, None)
        key = lease_key(model, instance, self._lease_prefix)
        await self._run([Call(key, ("SET", key, lease, "PX", max(1, int(ttl * 1000))))])

    async def _registered(self) -> list[tuple[str, str]]:
        (reply,) = await self._run([Call(self._global("instances"), ("HKEYS", self._global("instances")))])
        return sorted(parse_registry_value(v) for v in reply)

    async def instances(self) -> list[InstanceInfo]:
        pairs = await self._registered()
        calls = []
        for model, instance in pairs:
            st, _pend, _own, lease, *_logs = self._instance_keys(model, instance)
            calls += [Call(st, ("HMGET", st, "lease", "n:d")), Call(lease, ("GET", lease))]
        replies = await self._run(calls)
        infos = []
        for k, (model, instance) in enumerate(pairs):
            (lease, blocks), live = replies[2 * k], replies[2 * k + 1]
            if lease is None:
                continue
            infos.append(InstanceInfo(model, instance, _text(lease), live == lease, int(blocks or 0)))
        return infos

    async def expire(self) -> list[tuple[str, str]]:
        dead = [(i.model, i.instance) for i in await self.instances() if not i.alive]
        swept = []
        for model in sorted({m for m, _ in dead}):
            names = [inst for m, inst in dead if m == model]
            swept += [(model, inst) for inst in await self._drop(model, names, "sweep")]
        return sorted(swept)

    async def forget(self, model: str, instances: Sequence[str], ttl: float = FORGET_TTL_S) -> int:
        if not instances:
            return 0
        for instance in instances:
            self._leases_seen.get(model, {}).pop(instance, None)
        return len(await self._drop(model, list(instances), "forget", ttl))

    async def mark_shards(self, models: Sequence[str]) -> set[str]:
        """Put a marker key in every block shard of `models` (SET NX); returns the models where a
        marker was missing. A marker that vanished means its node lost its data (a cluster node
        restarted empty, or the whole Redis did): the caller asks the engines to re-sync."""
        calls, owners = [], []
        for model in models:
            for t in TIER_LETTER.values():
                for shard in range(SHARDS):
                    marker = index_shard_key(model, t, shard, self._prefix) + ":m"
                    calls.append(Call(marker, ("SET", marker, 1, "NX")))
                    owners.append(model)
        replies = await self._run(calls)
        return {model for model, reply in zip(owners, replies, strict=True) if reply is not None}

    async def block_size(self, model: str) -> int | None:
        key = self._global("block_size")
        (value,) = await self._run([Call(key, ("HGET", key, model))])
        return int(value) if value is not None else None

    async def ping(self) -> bool:
        try:
            await self._run([Call(self._global("models"), ("EXISTS", self._global("models")))])
            return True
        except IndexUnavailable:
            return False

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refreshing
        await self._slots.close()
        await self._client.aclose()


# (first block, packed holders): the holders of every block from `first` to the next run's first.
Run = tuple[int, bytes]


def _runs(reply: list) -> tuple[list[Run], int]:
    """READ's reply as runs, and how many blocks it read."""
    return list(zip(reply[0:-1:2], reply[1:-1:2], strict=True)), reply[-1]


def _compressed(values: list[bytes]) -> list[Run]:
    runs: list[Run] = []
    for i, value in enumerate(values):
        if not runs or value != runs[-1][1]:
            runs.append((i, value))
    return runs


def _holders(packed: bytes) -> set[bytes]:
    return {packed[k : k + HOLDER_BYTES] for k in range(0, len(packed), HOLDER_BYTES)}


def _walk(runs: list[Run], read: int) -> dict[bytes, int]:
    """holder id -> blocks it holds consecutively from block 0, for every holder of block 0. The
    blocks after the `read` first are nobody's."""
    if not runs or runs[0][0] != 0 or not runs[0][1]:
        return {}
    still = _holders(runs[0][1])
    counts: dict[bytes, int] = {}
    for start, value in runs[1:]:
        held = _holders(value)
        for h in still - held:
            counts[h] = start
        still &= held
        if not still:
            return counts
    for h in still:
        counts[h] = read
    return counts


def _instance_of(item: EventEnvelope | StreamEvent) -> tuple[str, str]:
    env = item.envelope if isinstance(item, StreamEvent) else item
    return env.model, env.instance


def _group_by_instance(
    events: Sequence[EventEnvelope | StreamEvent],
) -> dict[tuple[str, str, str], list[tuple[str, EventEnvelope]]]:
    """(model, instance, stream) -> its events in order: instances are independent of each other."""
    groups: dict[tuple[str, str, str], list[tuple[str, EventEnvelope]]] = {}
    for item in events:
        stream, entry_id, env = (
            (item.stream, item.entry_id, item.envelope) if isinstance(item, StreamEvent) else ("", "", item)
        )
        groups.setdefault((env.model, env.instance, stream), []).append((entry_id, env))
    return groups


def _event_args(entry_id: str, env: EventEnvelope) -> list:
    event = env.event
    hashes: tuple[BlockHash, ...] = ()
    tier = "device"
    if isinstance(event, BlockStored | BlockRemoved):
        hashes, tier = event.hashes, event.tier
    elif not isinstance(event, AllCleared):
        raise TypeError(f"not a KV event: {event!r}")
    return [entry_id, env.lease, holder_id(env.instance, env.lease), event.type, TIER_LETTER[tier], b"".join(hashes)]
