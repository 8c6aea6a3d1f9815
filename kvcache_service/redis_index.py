"""RedisIndex: the `Index` contract kept in Redis or a Redis Cluster, shared by every gateway and
KV cache service replica. The same code runs on both (common/redis_client.py picks the client).

Layout (P = kvharbor:idx:, M = model, I = instance; tags from common/redis_keys.py):

    P{M:<t><NN>}:b     HASH 16-byte block hash -> the 8-byte holder ids that hold it (tier t, shard NN)
    P{M:I}:st          HASH lease + holder of the applied events, block counts per tier,
                       cursor:<stream> (last applied entry of each stream)
    P{M:I}:h           HASH <tier letter><first hash byte> -> the instance's 16-byte hashes (packed)
    P{M:I}:pend        HASH shard ops written but maybe not yet applied (write-ahead, see below)
    P{M:I}:own         intake owner of the instance's stream (fence), PX ttl
    P{M}:holders       HASH holder id -> "I\\nlease", to name the holders a lookup finds
    P models, P block_size, P instances   small global keys

Why block -> holders: a lookup reads the prompt's blocks, not the instances. It groups the chain
by shard (16 shards per model and tier, so at most 16 HMGETs whatever the fleet size), walks it
once and stops counting a holder at its first missing block, so it costs O(blocks + holders of
the prompt), and engines that hold none of it cost nothing. A second round trip checks the
leases of the holders it found (their lease keys, MGET-like, one per holder). A holder id is
blake2b(instance, lease): a new life of an instance is another holder, so a late entry of the
old life never counts for the new one.

Memory per (block, instance) entry: 8 bytes of holder id in the block's field (the field's own
~70 bytes are shared by every holder of the block) plus 16 bytes in the instance's packed list,
which `cleared`, a new lease, a sweep and `forget` read to know what to remove.

Applying one instance's events spans slots (its own keys, and the block shards), so it runs in
three steps, each atomic on its slot:
  A. one script on the instance's slot: checks the fence (`own`), skips entries at or before the
     stream's cursor and events of another life, updates the packed list, moves the cursor, and
     writes the block-shard ops it implies to `pend` (a write-ahead record) before returning them;
  B. one script per block shard applies its ops (add a holder if absent, remove it if present);
  C. `pend` is deleted (only if it is still the record A wrote).
A consumer that dies between A and C leaves `pend` behind; whoever touches the instance next (A
answers "pending") replays it first. B's ops for one (block, holder) pair all sit in one shard
script, so replaying a record, once or twice, leaves the same state as applying it once: nothing
is lost and nothing counts twice. Any Redis failure or timeout raises `IndexUnavailable`.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope, Tier
from kvharbor.common.redis_client import Call, Script, SlotPipelines, connect
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
)

TIER_LETTER = {"device": "d", "shared": "s"}
SHARDS = 16  # block shards per (model, tier): bounds a lookup's commands, spreads a cluster's load
HOLDER_BYTES = 8
HASH_BYTES = 16
OP_BYTES = 1 + HASH_BYTES + HOLDER_BYTES  # '+'/'-', block hash, holder id

# Shared by the instance scripts. KEYS: st, h, pend, own, lease. Every key is the instance's.
_LUA_INSTANCE = """
local ST, H, PEND, OWN, LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local SHARDS = %d
local ops = {}
local function emit(op, t, h, holder)
  local g = t .. tostring(string.byte(h, 1) %% SHARDS)
  local list = ops[g]
  if not list then list = {} ops[g] = list end
  list[#list + 1] = op .. h .. holder
end
local function find(v, h, width)
  local s = 1
  while true do
    local i = string.find(v, h, s, true)
    if not i then return nil end
    if (i - 1) %% width == 0 then return i end
    s = i + 1
  end
end
local function drop_all(holder)
  local fields = redis.call('HGETALL', H)
  for k = 1, #fields, 2 do
    local t, v = string.sub(fields[k], 1, 1), fields[k + 1]
    for j = 1, #v, 16 do emit('-', t, string.sub(v, j, j + 15), holder) end
  end
  redis.call('DEL', H)
  redis.call('HSET', ST, 'n:d', 0, 'n:s', 0)
end
local function write_pending()
  local token = ARGV[1]
  local out = {}
  for g, list in pairs(ops) do
    local blob = table.concat(list)
    redis.call('HSET', PEND, 'g:' .. g, blob)
    out[#out + 1] = g
    out[#out + 1] = blob
  end
  if #out > 0 then redis.call('HSET', PEND, 'token', token) end
  return out
end
"""

_INSTANCE = _LUA_INSTANCE % SHARDS

# ARGV: token, stream ('' = unpositioned), fence owner ('' = none), then per event:
#       entry id, lease, holder id, type, tier letter, hashes blob
# Returns {applied, dropped holder or '', group, blob, ...}; {-1} fence lost; {-2} pending first.
_APPLY = Script(
    _INSTANCE
    + """
local stream, owner = ARGV[2], ARGV[3]
if owner ~= '' and redis.call('GET', OWN) ~= owner then return {-1} end
if redis.call('EXISTS', PEND) == 1 then return {-2} end
local cfield = 'cursor:' .. stream
local cursor = false
if stream ~= '' then cursor = redis.call('HGET', ST, cfield) end
local function pos(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function newer(id)
  if id == '' or not cursor then return true end
  local a, b = pos(id)
  local c, d = pos(cursor)
  return a > c or (a == c and b > d)
end
local live = redis.call('GET', LEASE)
local applied, dropped, i = 0, '', 4
while i <= #ARGV do
  local id, lease, holder, typ, t, blob = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4], ARGV[i+5]
  i = i + 6
  if newer(id) and (not live or live == lease) then
    local cur = redis.call('HMGET', ST, 'lease', 'holder')
    if cur[1] ~= lease then
      if cur[1] then drop_all(cur[2]) dropped = cur[2] end
      redis.call('HSET', ST, 'lease', lease, 'holder', holder)
    end
    if typ == 'stored' or typ == 'removed' then
      local n = 0
      for j = 1, #blob, 16 do
        local h = string.sub(blob, j, j + 15)
        local f = t .. string.sub(h, 1, 1)
        local v = redis.call('HGET', H, f) or ''
        local at = find(v, h, 16)
        if typ == 'stored' and not at then
          redis.call('HSET', H, f, v .. h)
          emit('+', t, h, holder)
          n = n + 1
        elseif typ == 'removed' and at then
          v = string.sub(v, 1, at - 1) .. string.sub(v, at + 16)
          if v == '' then redis.call('HDEL', H, f) else redis.call('HSET', H, f, v) end
          emit('-', t, h, holder)
          n = n - 1
        end
      end
      redis.call('HINCRBY', ST, 'n:' .. t, n)
    else
      drop_all(holder)
    end
    applied = applied + 1
  end
  -- Stale events (another life's lease) are consumed too: the cursor moves past them.
  if id ~= '' and newer(id) then cursor = id end
end
if stream ~= '' and cursor then redis.call('HSET', ST, cfield, cursor) end
local out = write_pending()
table.insert(out, 1, dropped)
table.insert(out, 1, applied)
return out
"""
)

# ARGV: token, mode ('sweep': only if the lease lapsed; 'forget': always, then tombstone),
#       tombstone lease, tombstone ttl ms. Returns {1 dropped | 0 not, holder, group, blob, ...}
#       or {-2} when a pending record must be replayed first.
_DROP = Script(
    _INSTANCE
    + """
local mode = ARGV[2]
if redis.call('EXISTS', PEND) == 1 then return {-2} end
local cur = redis.call('HMGET', ST, 'lease', 'holder')
local known = cur[1] ~= false and cur[1] ~= nil
if mode == 'sweep' and (not known or redis.call('GET', LEASE) == cur[1]) then return {0, ''} end
if known then
  drop_all(cur[2])
  redis.call('HDEL', ST, 'lease', 'holder', 'n:d', 'n:s')
end
if mode == 'forget' then redis.call('SET', LEASE, ARGV[3], 'PX', tonumber(ARGV[4])) end
local out = write_pending()
table.insert(out, 1, cur[2] or '')
table.insert(out, 1, known and 1 or 0)
return out
"""
)

# ARGV: token. Deletes the pending record if it is still the one with this token.
_DONE = Script(
    """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
)

# KEYS: one block shard. ARGV: ops blob ('+'/'-', 16-byte hash, 8-byte holder per op).
_SHARD = Script(
    """
local K, blob = KEYS[1], ARGV[1]
local function find(v, h)
  local s = 1
  while true do
    local i = string.find(v, h, s, true)
    if not i then return nil end
    if (i - 1) % 8 == 0 then return i end
    s = i + 1
  end
end
for j = 1, #blob, 25 do
  local op, h, holder = string.sub(blob, j, j), string.sub(blob, j + 1, j + 16), string.sub(blob, j + 17, j + 24)
  local v = redis.call('HGET', K, h) or ''
  local at = find(v, holder)
  if op == '+' and not at then
    redis.call('HSET', K, h, v .. holder)
  elseif op == '-' and at then
    v = string.sub(v, 1, at - 1) .. string.sub(v, at + 8)
    if v == '' then redis.call('HDEL', K, h) else redis.call('HSET', K, h, v) end
  end
end
return #blob / 25
"""
)


def holder_id(instance: str, lease: str) -> bytes:
    """The id one life (instance, lease) of an engine holds blocks under."""
    return hashlib.blake2b(f"{instance}\n{lease}".encode(), digest_size=HOLDER_BYTES).digest()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class RedisIndex:
    """`Index` on Redis. `client` is a redis.asyncio Redis or RedisCluster client returning
    bytes; its timeouts bound every call."""

    def __init__(self, client, prefix: str = INDEX_PREFIX, lease_prefix: str = LEASE_PREFIX) -> None:
        self._client = client
        self._prefix = prefix
        self._lease_prefix = lease_prefix
        self._slots = SlotPipelines(client)
        self._names: dict[tuple[str, bytes], tuple[str, str]] = {}  # holder id -> (instance, lease)

    @classmethod
    def from_url(cls, url: str, timeout: float = 1.0, **kwargs) -> RedisIndex:
        return cls(connect(url, timeout=timeout), **kwargs)

    # -- keys ---------------------------------------------------------------------------------

    def _instance_keys(self, model: str, instance: str) -> tuple[str, ...]:
        key = lambda part: index_instance_key(model, instance, part, self._prefix)  # noqa: E731
        return key("st"), key("h"), key("pend"), key("own"), lease_key(model, instance, self._lease_prefix)

    def _shard_key(self, model: str, group: str) -> str:
        return index_shard_key(model, group[0], int(group[1:]), self._prefix)

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
            calls.append(Call(keys[0], tuple(args), _APPLY, keys))
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
        shard_ops: list[Call] = []
        done: list[Call] = []
        extra: list[Call] = []
        for (model, instance, stream), call, reply in zip(batches, calls, replies, strict=True):
            if int(reply[0]) < 0:
                continue
            shard_ops += self._shard_calls(model, reply[2:])
            if reply[2:]:
                pend = call.keys[2]
                done.append(Call(pend, (call.args[0],), _DONE, (pend,)))
            extra += self._registry_calls(model, instance, batches[(model, instance, stream)], reply[1])
        await self._run(shard_ops + extra)
        await self._run(done)

    def _shard_calls(self, model: str, groups: list) -> list[Call]:
        calls = []
        for k in range(0, len(groups), 2):
            key = self._shard_key(model, _text(groups[k]))
            calls.append(Call(key, (groups[k + 1],), _SHARD, (key,)))
        return calls

    def _registry_calls(self, model: str, instance: str, batch: list, dropped: bytes) -> list[Call]:
        """The model-level and global records a batch implies (idempotent, so written each time)."""
        holders = index_model_key(model, "holders", self._prefix)
        calls = [
            Call(self._global("models"), ("SADD", self._global("models"), model)),
            Call(self._global("instances"), ("HSET", self._global("instances"), registry_value(model, instance), 1)),
        ]
        if dropped:
            calls.append(Call(holders, ("HDEL", holders, dropped)))
        leases = {env.lease for _, env in batch}
        for lease in leases:
            calls.append(Call(holders, ("HSET", holders, holder_id(instance, lease), f"{instance}\n{lease}")))
        sizes = {env.event.block_size for _, env in batch if isinstance(env.event, BlockStored)}
        for size in sizes:
            calls.append(Call(self._global("block_size"), ("HSET", self._global("block_size"), model, size)))
        return calls

    async def replay_pending(self, model: str, instance: str) -> bool:
        """Finish a pending record another consumer left (steps B and C); False if none."""
        pend = self._instance_keys(model, instance)[2]
        (record,) = await self._run([Call(pend, ("HGETALL", pend))])
        if not record:
            return False
        token = record.pop(b"token", b"")
        groups: list = []
        for field, blob in record.items():
            groups += [_text(field)[2:], blob]
        await self._run(self._shard_calls(model, groups))
        await self._run([Call(pend, (token,), _DONE, (pend,))])
        return True

    async def _drop(self, model: str, instances: Sequence[str], mode: str, ttl: float = 0.0) -> list[str]:
        """Sweep (lease lapsed) or forget instances: their entries go; returns those dropped."""
        calls = []
        for instance in instances:
            keys = self._instance_keys(model, instance)
            args = (uuid.uuid4().hex, mode, FORGOTTEN, max(1, int(ttl * 1000)))
            calls.append(Call(keys[0], args, _DROP, keys))
        replies = await self._run(calls)
        retry = []
        shard_ops, done, extra = [], [], []
        dropped = []
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
            shard_ops += self._shard_calls(model, reply[2:])
            if reply[2:]:
                pend = call.keys[2]
                done.append(Call(pend, (call.args[0],), _DONE, (pend,)))
        await self._run(shard_ops + extra)
        await self._run(done)
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
        values = await self._read_blocks(model, TIER_LETTER[tier], block_hashes)
        counts = _walk(values)
        if not counts:
            return {}
        names = await self._names_of(model, list(counts))
        wanted = set(instances) if instances is not None else None
        named = {h: names[h] for h in counts if h in names and (wanted is None or names[h][0] in wanted)}
        alive = await self._alive(model, list(named.values()))
        return {inst: counts[h] for h, (inst, lease) in named.items() if alive.get(inst) == lease}

    async def _read_blocks(self, model: str, t: str, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        by_shard: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            by_shard.setdefault(h[0] % SHARDS, []).append(i)
        calls = []
        for shard, idx in by_shard.items():
            key = index_shard_key(model, t, shard, self._prefix)
            calls.append(Call(key, ("HMGET", key, *(hashes[i] for i in idx))))
        values: list[bytes | None] = [None] * len(hashes)
        for idx, reply in zip(by_shard.values(), await self._run(calls), strict=True):
            for i, value in zip(idx, reply, strict=True):
                values[i] = value
        return values

    async def _names_of(self, model: str, holders: list[bytes]) -> dict[bytes, tuple[str, str]]:
        missing = [h for h in holders if (model, h) not in self._names]
        if missing:
            key = index_model_key(model, "holders", self._prefix)
            (reply,) = await self._run([Call(key, ("HMGET", key, *missing))])
            if len(self._names) > 100_000:
                self._names.clear()  # holder ids never change meaning: forgetting only costs a read
            for h, value in zip(missing, reply, strict=True):
                if value is not None:
                    self._names[(model, h)] = parse_registry_value(value)
        return {h: self._names[(model, h)] for h in holders if (model, h) in self._names}

    async def _alive(self, model: str, named: list[tuple[str, str]]) -> dict[str, str]:
        """instance -> the lease its lease key holds now (absent when it holds none)."""
        keys = [lease_key(model, inst, self._lease_prefix) for inst, _ in named]
        replies = await self._run([Call(k, ("GET", k)) for k in keys])
        return {inst: _text(v) for (inst, _), v in zip(named, replies, strict=True) if v is not None}

    async def renew(self, model: str, instance: str, lease: str, ttl: float) -> None:
        key = lease_key(model, instance, self._lease_prefix)
        await self._run([Call(key, ("SET", key, lease, "PX", max(1, int(ttl * 1000))))])

    async def _registered(self) -> list[tuple[str, str]]:
        (reply,) = await self._run([Call(self._global("instances"), ("HKEYS", self._global("instances")))])
        return sorted(parse_registry_value(v) for v in reply)

    async def instances(self) -> list[InstanceInfo]:
        pairs = await self._registered()
        calls = []
        for model, instance in pairs:
            st, *_, lease = self._instance_keys(model, instance)
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
        return len(await self._drop(model, list(instances), "forget", ttl))

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
        await self._slots.close()
        await self._client.aclose()


def _walk(values: list[bytes | None]) -> dict[bytes, int]:
    """holder id -> blocks it holds consecutively from block 0, for every holder of block 0."""
    first = values[0] if values else None
    if not first:
        return {}
    still = {first[k : k + HOLDER_BYTES] for k in range(0, len(first), HOLDER_BYTES)}
    counts: dict[bytes, int] = {}
    previous = first
    for j, value in enumerate(values[1:], start=1):
        if value == previous:
            continue  # the same holders as the block before (the common case): nothing drops
        held = set() if not value else {value[k : k + HOLDER_BYTES] for k in range(0, len(value), HOLDER_BYTES)}
        for h in still - held:
            counts[h] = j
        still &= held
        previous = value
        if not still:
            break
    for h in still:
        counts[h] = len(values)
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
