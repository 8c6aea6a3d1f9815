"""RedisIndex: the `Index` contract kept in Redis, shared by every gateway and service replica.

Keys (P = kvharbor:idx: by default, M = model):
    P M :i: <tier letter>:<inst> SET of the 16-byte hashes an instance holds (tier d = device, s = shared)
    P M :reg                    HASH instance -> lease of the events applied for it
    P models                    SET of models seen
    P cursor                    HASH stream -> last applied entry id (exactly-once intake)
    P block_size                HASH model -> block size of its `stored` events

Every operation is one Lua script call: one round trip, and atomic, so a lookup never sees half an
event and the intake cursor moves together with the index. Hash chains travel as one binary
argument (16 bytes per block): per-argument encoding in the client cost more than the lookup
itself. A lookup asks each alive instance's set
about the chain in slices (SMISMEMBER) and stops at its first missing block, so it costs about
`matched blocks + one slice` per instance. Needs Redis >= 6.2 (SMISMEMBER, XAUTOCLAIM). Any Redis
failure or timeout raises `IndexUnavailable` within `timeout` seconds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope, Tier
from kvharbor.common.redis_keys import INDEX_PREFIX, LEASE_PREFIX, lease_key
from kvharbor.kvcache_service.index import (
    FORGET_TTL_S,
    FORGOTTEN,
    IndexUnavailable,
    InstanceInfo,
    LeadershipLost,
    StreamEvent,
)

TIER_LETTER = {"device": "d", "shared": "s"}

_LUA_COMMON = """
local P, LP = ARGV[1], ARGV[2]
local function clear(model, inst)
  redis.call('DEL', P .. model .. ':i:d:' .. inst, P .. model .. ':i:s:' .. inst)
end
local function alive(model, inst, lease)
  return lease and redis.call('GET', LP .. model .. ':' .. inst) == lease
end
local function split(blob)
  local out = {}
  for k = 1, #blob, 16 do out[#out + 1] = string.sub(blob, k, k + 15) end
  return out
end
"""

# ARGV: P, LP, stream, fence lock key ('' = none), fence owner, then per event:
#       id, model, instance, lease, type, tier letter, block size, hashes blob
# Returns the number applied, or -1 (nothing done) when the fence lock is not held by its owner.
_APPLY = (
    _LUA_COMMON
    + """
local stream = ARGV[3]
if ARGV[4] ~= '' and redis.call('GET', ARGV[4]) ~= ARGV[5] then return -1 end
local cursor = false
if stream ~= '' then cursor = redis.call('HGET', P .. 'cursor', stream) end
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
local applied, i = 0, 6
while i <= #ARGV do
  local id, model, inst, lease, typ, t, bs = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4], ARGV[i+5], ARGV[i+6]
  local hashes = split(ARGV[i+7])
  i = i + 8
  local live = redis.call('GET', LP .. model .. ':' .. inst)
  if newer(id) and (not live or live == lease) then
    redis.call('SADD', P .. 'models', model)
    local reg = P .. model .. ':reg'
    local cur = redis.call('HGET', reg, inst)
    if cur ~= lease then
      if cur then clear(model, inst) end
      redis.call('HSET', reg, inst, lease)
    end
    local ik = P .. model .. ':i:' .. t .. ':' .. inst
    if typ == 'stored' then
      redis.call('HSET', P .. 'block_size', model, bs)
      for j = 1, #hashes, 4000 do
        redis.call('SADD', ik, unpack(hashes, j, math.min(j + 3999, #hashes)))
      end
    elseif typ == 'removed' then
      for j = 1, #hashes, 4000 do
        redis.call('SREM', ik, unpack(hashes, j, math.min(j + 3999, #hashes)))
      end
    else
      clear(model, inst)
    end
    applied = applied + 1
  end
  -- Stale events (another life's lease) are consumed too: the cursor moves past them.
  if id ~= '' and newer(id) then cursor = id end
end
if stream ~= '' and cursor then redis.call('HSET', P .. 'cursor', stream, cursor) end
return applied
"""
)

# ARGV: P, LP, model, tier letter, number of instance filters, filters..., hashes blob
_LOOKUP = (
    _LUA_COMMON
    + """
local model, t = ARGV[3], ARGV[4]
local nf = tonumber(ARGV[5])
local wanted = nil
if nf > 0 then
  wanted = {}
  for k = 6, 5 + nf do wanted[ARGV[k]] = true end
end
local reg = redis.call('HGETALL', P .. model .. ':reg')
local hashes = split(ARGV[6 + nf])
local first, last = 1, #hashes
local counts = {}
for k = 1, #reg, 2 do
  local inst = reg[k]
  if (wanted == nil or wanted[inst]) and alive(model, inst, reg[k + 1]) then
    local key = P .. model .. ':i:' .. t .. ':' .. inst
    local matched, j, broken = 0, first, false
    -- Slices grow so a long match costs few calls and a short one reads little.
    local slice = 64
    while j <= last and not broken do
      local upto = math.min(j + slice - 1, last)
      local found = redis.call('SMISMEMBER', key, unpack(hashes, j, upto))
      for _, hit in ipairs(found) do
        if hit == 0 then broken = true break end
        matched = matched + 1
      end
      j = upto + 1
      slice = math.min(slice * 4, 4000)
    end
    counts[inst] = matched
  end
end
local out = {}
for inst, c in pairs(counts) do
  out[#out + 1] = inst
  out[#out + 1] = c
end
return out
"""
)

# ARGV: P, LP, sweep (1 = drop dead instances). Returns model, instance, lease, alive, blocks per instance.
_INSTANCES = (
    _LUA_COMMON
    + """
local sweep = ARGV[3] == '1'
local out = {}
for _, model in ipairs(redis.call('SMEMBERS', P .. 'models')) do
  local reg = redis.call('HGETALL', P .. model .. ':reg')
  for k = 1, #reg, 2 do
    local inst, lease = reg[k], reg[k + 1]
    local ok = alive(model, inst, lease)
    if sweep and not ok then
      clear(model, inst)
      redis.call('HDEL', P .. model .. ':reg', inst)
    end
    if (not sweep) or (not ok) then
      local blocks = redis.call('SCARD', P .. model .. ':i:d:' .. inst)
      out[#out + 1] = model
      out[#out + 1] = inst
      out[#out + 1] = lease
      out[#out + 1] = ok and 1 or 0
      out[#out + 1] = blocks
    end
  end
end
return out
"""
)

# ARGV: P, LP, model, tombstone ttl ms, tombstone lease, instances...
# The tombstone lease makes apply skip the instances' late events (their lease is not the live one).
_FORGET = (
    _LUA_COMMON
    + """
local model, known = ARGV[3], 0
for k = 6, #ARGV do
  local inst = ARGV[k]
  clear(model, inst)
  known = known + redis.call('HDEL', P .. model .. ':reg', inst)
  redis.call('SET', LP .. model .. ':' .. inst, ARGV[5], 'PX', tonumber(ARGV[4]))
end
return known
"""
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisIndex:
    """`Index` on Redis. `client` is a redis.asyncio client; its timeouts bound every call."""

    def __init__(self, client, prefix: str = INDEX_PREFIX, lease_prefix: str = LEASE_PREFIX) -> None:
        self._client = client
        self._prefix = prefix
        self._lease_prefix = lease_prefix
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)
        self._instances = client.register_script(_INSTANCES)
        self._forget = client.register_script(_FORGET)

    @classmethod
    def from_url(cls, url: str, timeout: float = 1.0, **kwargs) -> RedisIndex:
        import redis.asyncio as redis

        client = redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return cls(client, **kwargs)

    async def _guarded(self, call: Awaitable) -> object:
        """Await one Redis call; any Redis failure or timeout becomes IndexUnavailable."""
        from redis.exceptions import RedisError

        try:
            return await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise IndexUnavailable(f"KV index in Redis unavailable: {type(exc).__name__}: {exc}") from exc

    async def _call(self, script, args: list) -> object:
        return await self._guarded(script(args=[self._prefix, self._lease_prefix, *args]))

    async def apply(self, events: Sequence[EventEnvelope | StreamEvent], fence: tuple[str, str] | None = None) -> int:
        applied = 0
        for stream, batch in _group_by_stream(events):
            args: list = [stream, *(fence or ("", ""))]
            for entry_id, env in batch:
                args += _event_args(entry_id, env)
            done = int(await self._call(self._apply, args))
            if done < 0:
                raise LeadershipLost(f"intake lock {fence[0]!r} is no longer held by {fence[1]!r}")
            applied += done
        return applied

    async def lookup(
        self,
        model: str,
        block_hashes: Sequence[BlockHash],
        instances: Sequence[str] | None = None,
        tier: Tier = "device",
    ) -> dict[str, int]:
        wanted = list(instances) if instances is not None else []
        if instances is not None and not wanted:
            return {}
        args = [model, TIER_LETTER[tier], len(wanted), *wanted, b"".join(block_hashes)]
        flat = await self._call(self._lookup, args)
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def renew(self, model: str, instance: str, lease: str, ttl: float) -> None:
        key = lease_key(model, instance, self._lease_prefix)
        await self._guarded(self._client.set(key, lease, px=max(1, int(ttl * 1000))))

    async def _list(self, sweep: bool) -> list[InstanceInfo]:
        flat = await self._call(self._instances, ["1" if sweep else "0"])
        rows = [flat[i : i + 5] for i in range(0, len(flat), 5)]
        infos = [
            InstanceInfo(_text(m), _text(i), _text(lease), bool(int(ok)), int(blocks))
            for m, i, lease, ok, blocks in rows
        ]
        return sorted(infos, key=lambda info: (info.model, info.instance))

    async def instances(self) -> list[InstanceInfo]:
        return await self._list(sweep=False)

    async def expire(self) -> list[tuple[str, str]]:
        return [(info.model, info.instance) for info in await self._list(sweep=True)]

    async def forget(self, model: str, instances: Sequence[str], ttl: float = FORGET_TTL_S) -> int:
        if not instances:
            return 0
        return int(await self._call(self._forget, [model, max(1, int(ttl * 1000)), FORGOTTEN, *instances]))

    async def block_size(self, model: str) -> int | None:
        value = await self._guarded(self._client.hget(self._prefix + "block_size", model))
        return int(value) if value is not None else None

    async def ping(self) -> bool:
        from redis.exceptions import RedisError

        try:
            return bool(await self._client.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    async def close(self) -> None:
        await self._client.aclose()


def _group_by_stream(
    events: Sequence[EventEnvelope | StreamEvent],
) -> list[tuple[str, list[tuple[str, EventEnvelope]]]]:
    """Consecutive runs of one stream (positioned) or of unpositioned events (stream '')."""
    groups: list[tuple[str, list[tuple[str, EventEnvelope]]]] = []
    for item in events:
        stream, entry_id, env = (
            (item.stream, item.entry_id, item.envelope) if isinstance(item, StreamEvent) else ("", "", item)
        )
        if not groups or groups[-1][0] != stream:
            groups.append((stream, []))
        groups[-1][1].append((entry_id, env))
    return groups


def _event_args(entry_id: str, env: EventEnvelope) -> list:
    event = env.event
    hashes: tuple[BlockHash, ...] = ()
    tier, block_size = "device", 0
    if isinstance(event, BlockStored):
        hashes, tier, block_size = event.hashes, event.tier, event.block_size
    elif isinstance(event, BlockRemoved):
        hashes, tier = event.hashes, event.tier
    elif not isinstance(event, AllCleared):
        raise TypeError(f"not a KV event: {event!r}")
    return [
        entry_id,
        env.model,
        env.instance,
        env.lease,
        event.type,
        TIER_LETTER[tier],
        block_size,
        b"".join(hashes),
    ]
