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
    P layout, P layout:old   the shard key layout (LAYOUT); set while keys of an older one remain

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
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence

from kvharbor.common.block_hash import DIGEST_SIZE, BlockHash
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

log = logging.getLogger("kvharbor.kvcache.index")

TIER_LETTER = {"device": "d", "shared": "s"}
# Block shards per (model, tier): a cluster lookup runs one script per shard (16 measured 2.0 ms
# p99 against 8's 1.8 at 1,000 engines on 3 masters), and one model's index spreads over at most
# this many slots per tier.
SHARDS = 8
# Buckets per shard: hash bytes 2 and 3, raw, are the bucket key's suffix (65,536 buckets). Small
# hashes stay in Redis's compact encoding (up to 128 fields of <= 64 bytes, hash-max-listpack-*),
# about 30 bytes a field instead of about 90 in a hash table. At 10M distinct blocks a bucket holds
# ~19 fields: an HGET scans half of what 32,768 buckets made it scan (3.6 us a read measured there
# on a 2-core EPYC VM), for ~2 more bytes an entry of key overhead. The raw bytes, not a number:
# formatting a number in Lua cost more than the read (1.2 us a block). Beyond ~20M distinct
# blocks per model and tier, buckets grow into hash tables.
BUCKET_BYTES = 2
# The block shards' key layout, kept in `P layout` and named in the shard keys (`:b2`). Bumped
# when it changes (2: the raw 2-byte bucket suffix; 1, unnamed, `:b`: a decimal of 32,768): blocks
# written in another layout are not where this build reads them, so the intake asks every engine
# to re-sync (`claim_layout`).
LAYOUT = "2"
# Layout 1's block shard keys (`:b:` then a decimal bucket, or `m` for the marker). Nothing reads
# them once an intake replica has claimed layout 2; the leader removes them a batch per sweep.
_LAYOUT_1_KEY = re.compile(rb"\{[^{}]*:[a-z]\d\d\}:b:(?:\d+|m)")
HOLDER_BYTES = 8
# A lookup re-reads a holder's lease key at most this often (in the background for readings up
# to twice as old): no second round trip on most lookups, for an engine that dies dropping out
# of lookups up to twice this later than its lease.
LIVENESS_CACHE_S = 0.25
REGISTRY_REFRESH_S = 5.0
HASH_BYTES = 16
_UNSEEN = (None, 0.0)  # the lease reading of an instance never read: no lease, stale

# Shared by the instance scripts. KEYS: st, pend, own, lease, then the block logs of tier d and of
# tier s. Every key is the instance's (one slot). A log is the instance's stored and removed
# hashes in order, as entries of: op ('+'/'-'), count (2 bytes), that many 16-byte hashes; it is
# appended to (cheap) and read only to drop everything, or to fold it up when it grew long.
_LUA_INSTANCE = """
local ST, PEND, OWN, LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local LOGS = {d = KEYS[5], s = KEYS[6]}
local records = {}
local function record(op, t, holder, blob)
  if #blob > 0 then records[#records + 1] = op .. t .. holder .. blob end
end
-- Consecutive events of one op, tier and holder go to the log and the shards as one entry and one
-- record: most events carry one hash, and an APPEND, a record and a pending field per event
-- were most of the intake's Redis time. Order is kept, so a block's ops stay in sequence.
local run_op, run_t, run_holder, run_parts = nil, nil, nil, {}
local function log(t, op, blob)
  for j = 1, #blob, 16 * 65535 do
    local part = string.sub(blob, j, j + 16 * 65535 - 1)
    local n = #part / 16
    redis.call('APPEND', LOGS[t], op .. string.char(math.floor(n / 256), n % 256) .. part)
  end
end
-- What a tier's log says the instance holds now, in the order it was stored (set semantics, as
-- the block shards keep it).
local function held(t)
  local text = redis.call('GET', LOGS[t]) or ''
  local has, order, pos = {}, {}, 1
  while pos < #text do
    local op = string.sub(text, pos, pos)
    local n = string.byte(text, pos + 1) * 256 + string.byte(text, pos + 2)
    pos = pos + 3
    for _ = 1, n do
      local h = string.sub(text, pos, pos + 15)
      pos = pos + 16
      if op == '+' then
        if not has[h] then order[#order + 1] = h end
        has[h] = true
      else
        has[h] = nil
      end
    end
  end
  local out = {}
  for _, h in ipairs(order) do if has[h] then out[#out + 1] = h has[h] = nil end end
  return out
end
local function flush()
  if run_op then
    local blob = table.concat(run_parts)
    log(run_t, run_op, blob)
    record(run_op, run_t, run_holder, blob)
    run_op, run_parts = nil, {}
  end
end
local function add(op, t, holder, blob)
  if op ~= run_op or t ~= run_t or holder ~= run_holder then
    flush()
    run_op, run_t, run_holder = op, t, holder
  end
  run_parts[#run_parts + 1] = blob
end
local function drop_all(holder)
  flush()
  for _, t in ipairs({'d', 's'}) do
    record('x', t, holder, table.concat(held(t)))  -- 'x': remove, and count it
    redis.call('DEL', LOGS[t])
  end
end
-- A log that grew to twice what the instance holds (and past 64 KiB) is folded up.
local function compact(t)
  flush()
  local size = redis.call('STRLEN', LOGS[t])
  local n = tonumber(redis.call('HGET', ST, 'n:' .. t) or '0')
  if size >= 65536 and size > 2 * (16 * n + 3) then
    local keep = table.concat(held(t))
    redis.call('DEL', LOGS[t])
    log(t, '+', keep)
  end
end
local function write_pending()
  if #records == 0 then return {} end
  local fields = {'token', ARGV[1]}
  for k, rec in ipairs(records) do
    fields[#fields + 1] = string.format('e%08d', k)
    fields[#fields + 1] = rec
  end
  redis.call('HSET', PEND, unpack(fields))
  return records
end
"""

# ARGV: token, stream ('' = unpositioned), fence owner ('' = none), then per event:
#       entry id, lease, holder id, type, tier letter, hashes blob
# Returns {applied, dropped holder or '', record, ...} (a record: op, tier, holder, hashes);
# {-1} fence lost; {-2} a pending record must be replayed first.
_APPLY = Script(
    _LUA_INSTANCE
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
local cms, cseq  -- the cursor's position, parsed once
if cursor then cms, cseq = pos(cursor) end
local live_lease = redis.call('GET', LEASE)
local cur = redis.call('HMGET', ST, 'lease', 'holder')
local applied, dropped, i, removed = 0, '', 4, {}
while i <= #ARGV do
  local id, lease, holder, typ, t, blob = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4], ARGV[i+5]
  i = i + 6
  local fresh, ms, seq = true, nil, nil
  if id ~= '' then
    ms, seq = pos(id)
    fresh = not cms or ms > cms or (ms == cms and seq > cseq)
  end
  if fresh and (not live_lease or live_lease == lease) then
    if cur[1] ~= lease then
      if cur[1] then drop_all(cur[2]) dropped = cur[2] end
      redis.call('HSET', ST, 'lease', lease, 'holder', holder)
      cur = {lease, holder}
    end
    if typ == 'stored' then
      add('+', t, holder, blob)
    elseif typ == 'removed' then
      add('-', t, holder, blob)
      removed[t] = true
    else
      drop_all(holder)
    end
    applied = applied + 1
  end
  -- Stale events (another life's lease) are consumed too: the cursor moves past them.
  if id ~= '' and fresh then cursor, cms, cseq = id, ms, seq end
end
flush()
for t in pairs(removed) do compact(t) end
if stream ~= '' and cursor then redis.call('HSET', ST, cfield, cursor) end
local out = write_pending()
table.insert(out, 1, dropped)
table.insert(out, 1, applied)
return out
"""
)

# ARGV: token, mode ('sweep': only if the lease lapsed; 'forget': always, then tombstone),
#       tombstone lease, tombstone ttl ms. Returns {1 dropped | 0 not, holder, record, ...}
#       or {-2} when a pending record must be replayed first.
_DROP = Script(
    _LUA_INSTANCE
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

# KEYS: pend, st. ARGV: token, blocks gained in tier d, in tier s. Deletes the pending record if
# it is still the one with this token, and counts what the shards said changed (exact, unlike the
# logs: a block stored twice is held once).
_DONE = Script(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
for k, t in ipairs({'d', 's'}) do
  local n = tonumber(ARGV[k + 1])
  if n ~= 0 then redis.call('HINCRBY', KEYS[2], 'n:' .. t, n) end
end
return 1
"""
)

# The bucket of a block inside its shard: hash bytes 2 and 3 (byte 1 picked the shard).
_LUA_BUCKET = f"""
local function bucket(h)
  return string.sub(h, 2, {1 + BUCKET_BYTES})
end
"""

# KEYS: the shard's anchor (routes the call; every bucket key carries the shard's tag).
# ARGV: bucket key prefix, then records in order: op ('+' store, '-' or 'x' remove: 'x' when the
# instance drops everything), 8-byte holder id, 16-byte hashes. Returns, per record, the blocks it
# added (or, negative, removed).
_SHARD = Script(
    _LUA_BUCKET
    + """
local P = ARGV[1]
local function find(v, h)
  local s = 1
  while true do
    local i = string.find(v, h, s, true)
    if not i then return nil end
    if (i - 1) % 8 == 0 then return i end
    s = i + 1
  end
end
local changed = {}
for a = 2, #ARGV do
  local rec = ARGV[a]
  local op, holder = string.sub(rec, 1, 1), string.sub(rec, 2, 9)
  local n = 0
  for j = 10, #rec, 16 do
    local h = string.sub(rec, j, j + 15)
    local K = P .. bucket(h)
    if op == '+' then
      -- A block nobody held yet (the common case) costs one call.
      if redis.call('HSETNX', K, h, holder) == 1 then
        n = n + 1
      else
        local v = redis.call('HGET', K, h)
        if not find(v, holder) then redis.call('HSET', K, h, v .. holder) n = n + 1 end
      end
    else
      local v = redis.call('HGET', K, h)
      local at = v and find(v, holder)
      if at then
        v = string.sub(v, 1, at - 1) .. string.sub(v, at + 8)
        if v == '' then redis.call('HDEL', K, h) else redis.call('HSET', K, h, v) end
        n = n - 1
      end
    end
  end
  changed[#changed + 1] = n
end
return changed
"""
)


# KEYS: the shards' anchors (all SHARDS, in order, on a single Redis; the one shard read, on a
# cluster). ARGV: '1' to stop at the first block nobody holds, then the chain's 16-byte hashes as
# one string: one argument instead of two per block (a bucket key and a field) took the client's
# packing and Redis's parsing out of a 256-block lookup. Returns runs: the index (from 0) where
# the holders change and the new holders ('' for none), pair after pair, then how many blocks it
# read. A shared prefix's blocks all have the same holders, so a popular prompt's reply is a few
# runs, not a value a block. Per block this does one HGET and two string builds, no more:
# on a 2-core EPYC VM a block cost 8 us (3.6 of them the HGET) with a number formatted into the key
# and a table entry a block. The bucket comes from `_LUA_BUCKET`, as the writes' does: one rule
# for both sides (inlined it saved 0.1-0.15 us a block, ~2% of a lookup's Redis time, not worth
# a second copy that could drift).
_READ = Script(
    _LUA_BUCKET
    + f"""
local call, sub, byte = redis.call, string.sub, string.byte
local stop, chain, one = ARGV[1] == '1', ARGV[2], #KEYS == 1
local anchors = {{}}
for k = 1, #KEYS do anchors[k] = KEYS[k] .. ':' end
local out, n, last, read = {{}}, 0, nil, 0
for j = 1, #chain, {DIGEST_SIZE} do
  local h = sub(chain, j, j + {DIGEST_SIZE - 1})
  local anchor = one and anchors[1] or anchors[byte(h, 1) % {SHARDS} + 1]
  local v = call('HGET', anchor .. bucket(h), h)
  if not v then
    if stop then break end
    v = ''
  end
  if v ~= last then
    out[n + 1], out[n + 2], n, last = read, v, n + 2, v
  end
  read = read + 1
end
out[n + 1] = read
return out
"""
)


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
        shard_calls = [self._shard_call(_SHARD, m, t, shard, args) for (m, t, shard), (args, _) in per.items()]
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
                done.append(Call(pend, (call.args[0], d, s), _DONE, (pend, st)))
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
        await self._ship([(model, Call(keys[0], (token,), _APPLY, keys), records)])
        return True

    async def _drop(self, model: str, instances: Sequence[str], mode: str, ttl: float = 0.0) -> list[str]:
        """Sweep (lease lapsed) or forget instances: their entries go; returns those dropped."""
        calls = []
        for instance in instances:
            keys = self._instance_keys(model, instance)
            args = (uuid.uuid4().hex, mode, FORGOTTEN, max(1, int(ttl * 1000)))
            calls.append(Call(keys[0], args, _DROP, keys))
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
            (reply,) = await self._run([Call(anchors[0], ("1", chain), _READ, tuple(anchors))])
            return _runs(reply)
        by_shard: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            by_shard.setdefault(h[0] % SHARDS, []).append(i)
        calls = []
        for shard, idx in by_shard.items():
            args = ("0", b"".join(hashes[i] for i in idx))
            calls.append(Call(anchors[shard], args, _READ, (anchors[shard],)))
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

    async def claim_layout(self) -> bool:
        """Record this build's shard layout; True when Redis held an index in another one (or in
        none named: written before layouts were): what it indexed is unreadable here, and only
        the engines can say again what they hold. A Redis with no layout and no instance yet is
        new, not old: False."""
        key, registered = self._global("layout"), self._global("instances")
        found, instances = await self._run([Call(key, ("GET", key)), Call(registered, ("HLEN", registered))])
        if found == LAYOUT.encode():
            return False
        older = found is not None or int(instances) > 0
        if older:  # marked before the layout moves, so no crash in between can leave its keys unmarked
            old_key = self._global("layout:old")
            await self._run([Call(old_key, ("SET", old_key, found or b"1"))])
        (swapped,) = await self._run([Call(key, ("SET", key, LAYOUT, "GET"))])
        return older and swapped != LAYOUT.encode()  # one replica of several starting at once

    async def old_layout_left(self) -> bool:
        """Whether keys of an older layout may remain (`claim_layout` found one; `old_layout_removed`
        has not been called since)."""
        key = self._global("layout:old")
        (found,) = await self._run([Call(key, ("EXISTS", key))])
        return bool(int(found))

    async def old_layout_pages(self, page: int = 1000) -> AsyncIterator[list[bytes]]:
        """The block shard keys of layout 1, one SCAN call (COUNT `page`) at a time on each node in
        turn, so a caller bounds its work in calls, not in keys found (the block store shares the
        keyspace: old keys may be sparse). Each is checked against the old key's form, so no other
        key can be taken for one. A page may be empty."""
        prefix, pattern = self._prefix.encode(), self._prefix + "{*}:b:*"
        client = self._client
        for node in client.get_primaries() if self._slots.cluster else [None]:
            cursor = 0
            while True:
                if node is None:
                    cursor, keys = await client.scan(cursor=cursor, match=pattern, count=page)
                else:
                    cursors, keys = await client.scan(cursor=cursor, match=pattern, count=page, target_nodes=node)
                    cursor = cursors[node.name]
                yield [k for k in keys if k.startswith(prefix) and _LAYOUT_1_KEY.fullmatch(k, len(prefix))]
                if not cursor:
                    break

    async def unlink(self, keys: Sequence[bytes]) -> int:
        """UNLINK `keys`; how many there were (SCAN may return a key twice)."""
        return sum(int(n) for n in await self._run([Call(_text(k), ("UNLINK", k)) for k in keys]))

    async def old_layout_removed(self) -> None:
        key = self._global("layout:old")
        await self._run([Call(key, ("DEL", key))])

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
    """_READ's reply as runs, and how many blocks it read."""
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
