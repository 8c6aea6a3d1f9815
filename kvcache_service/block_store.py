"""The shared KV block store: tier 2, where one engine leaves KV blocks that another can pull
instead of recomputing their prefill.

A stored block is self-describing: a header says which model (by name and weights fingerprint),
which layout, which dtype and which block hash it holds, with a checksum of its payload. A reader
states what it expects (`BlockFormat`) and gets only blocks that match in every respect; anything
else is refused loudly (`BlockRefused`, logged, counted), never used. Corrupt blocks are deleted.

`BlockStore` is the interface; `RedisBlockStore` keeps blocks in Redis under a byte cap with LRU
eviction. Another tier (local disk, a dedicated store) only has to implement the same three calls.

Redis keys (S = kvharbor:blk:, T = {sNN}: the hash tag of shard NN, common/redis_keys.py):
    S T:<model>:<layout>:<dtype>:<fingerprint>:<hash hex>   one block: header + payload
    S T:lru                         ZSET key -> logical clock of last use, in this shard
    S T:sizes                       HASH key -> bytes
    S T:bytes / S T:clock / S T:evictions counters;  S T:cap  the shard's byte cap

Shards, so that the same code runs on one Redis and on a Redis Cluster: a block lives in shard
`block_hash[0] % STORE_SHARDS`, and every key of a shard carries the shard's tag, so all of them
share one hash slot. Each shard is the old single store in small: its own LRU zset, size ledger,
byte counter and cap, and every put, eviction, read and drop on it is one Lua script on that one
slot, atomic as before. An operation over many blocks sends one script per shard it touches
(at most STORE_SHARDS, whatever the run length), through common.redis_client.SlotPipelines: one
pipeline per node, the nodes in parallel; on one Redis, one pipeline.

What sharding changes:
- The byte cap is split over the shards (`shard_caps`: the total divided evenly, the remainder to
  the first shards, so the shard caps add up to the total exactly). Total bytes never exceed the
  total cap. Block hashes are uniform, so shards fill evenly and eviction is LRU within a shard:
  globally it approximates LRU, and a full store holds the cap less a block or so per shard. A
  shard's cap must be several blocks (the default 1 GiB is 64 MiB a shard; a cap under
  STORE_SHARDS x block size keeps nothing, as a cap under one block did before).
- `get_run` reads each shard's part of the run in one script, which stops at that shard's first
  missing block, all shards in one round trip; blocks of other shards that lie after the run's
  first miss may still be read (their bytes sent, then dropped) and have their LRU touched. The
  run is cut at the first miss in the caller's order and checked block by block exactly as
  before; the extra touches only make those blocks look recent. A chain's blocks after a miss
  are rarely stored, so little moves for nothing (and callers pull in bounded slices).
- 16 shards: few enough that one operation is a bounded handful of scripts, enough distinct
  slots to spread the store over the nodes of a usual cluster (16 tags, 16 slots, which an
  operator can move). Changing STORE_SHARDS, like the move from the unsharded layout, moves
  every block key: the old keys are then unreachable and go only by Redis's own maxmemory
  policy or a flush.

The ledger (`sizes`) makes the byte count right even when keys vanish behind the store's back
(DEL by hand, Redis maxmemory eviction): a key counts in `bytes` exactly while it has a `sizes`
entry, per shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvharbor.common.block_hash import BlockHash, to_hex
from kvharbor.common.redis_client import Call, Script, SlotPipelines, connect
from kvharbor.common.redis_keys import STORE_PREFIX, store_shard_tag

log = logging.getLogger("kvharbor.kvcache.store")

MAGIC = b"KVHB"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sBI")  # magic, version, header length
DEFAULT_CAP_BYTES = 1 << 30
STORE_SHARDS = 16


class BlockStoreUnavailable(RuntimeError):
    """The store cannot answer now; the engine recomputes instead."""


class BlockRefused(ValueError):
    """A stored block that must not be used: wrong model, layout or dtype, or a bad checksum."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # fingerprint | layout | dtype | checksum | format


@dataclass(frozen=True)
class BlockFormat:
    """What a block's bytes mean: who may read them."""

    model: str
    fingerprint: str  # identity of the weights (engine/kv/kv_transfer.py computes it)
    layout: str  # e.g. "hm1:L30:H3:D64:B16" - tensor order and shape of one block
    dtype: str  # e.g. "bfloat16"
    block_bytes: int  # payload size of one block

    @property
    def tag(self) -> str:
        """Layout, dtype and weights in one string: blocks of two formats with the same tag are
        interchangeable (the gateway compares engines' tags before it sends a pull or a hand-off)."""
        return f"{self.layout}:{self.dtype}:{self.fingerprint[:16]}"

    def key(self, block_hash: BlockHash, prefix: str = STORE_PREFIX) -> str:
        # dtype and weights are in the key too: fleets that differ there keep apart instead of
        # refusing each other's blocks forever. The header checks still catch a wrong writer.
        # The shard's tag puts the block on its shard's slot (see the module docstring).
        return f"{shard_prefix(store_shard(block_hash), prefix)}{self.model}:{self.tag}:{to_hex(block_hash)}"


def store_shard(block_hash: BlockHash) -> int:
    """The shard that holds `block_hash`: its first byte modulo STORE_SHARDS (hashes are uniform)."""
    return block_hash[0] % STORE_SHARDS


def shard_prefix(shard: int, prefix: str = STORE_PREFIX) -> str:
    """The start of every key of `shard`: the store prefix and the shard's hash tag."""
    return f"{prefix}{store_shard_tag(shard)}:"


def shard_caps(total: int) -> list[int]:
    """`total` bytes split over the shards: even shares, the remainder to the first ones."""
    share, rest = divmod(max(0, int(total)), STORE_SHARDS)
    return [share + (1 if shard < rest else 0) for shard in range(STORE_SHARDS)]


def checksum(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode_block(fmt: BlockFormat, block_hash: BlockHash, payload: bytes) -> bytes:
    if len(payload) != fmt.block_bytes:
        raise ValueError(f"a {fmt.layout} {fmt.dtype} block is {fmt.block_bytes} bytes, got {len(payload)}")
    header = json.dumps(
        {
            "model": fmt.model,
            "fingerprint": fmt.fingerprint,
            "layout": fmt.layout,
            "dtype": fmt.dtype,
            "hash": to_hex(block_hash),
            "nbytes": len(payload),
            "checksum": checksum(payload),
        },
        separators=(",", ":"),
    ).encode()
    return _HEAD.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def decode_block(fmt: BlockFormat, block_hash: BlockHash, blob: bytes) -> bytes:
    """The payload of `blob` if it is exactly the block `fmt` and `block_hash` ask for; else BlockRefused."""
    try:
        magic, version, head_len = _HEAD.unpack_from(blob)
        header = json.loads(blob[_HEAD.size : _HEAD.size + head_len])
    except (struct.error, ValueError) as exc:
        raise BlockRefused("format", f"not a kvharbor KV block: {exc}") from None
    if magic != MAGIC or version != FORMAT_VERSION or not isinstance(header, dict):
        raise BlockRefused("format", f"not a kvharbor KV block of format version {FORMAT_VERSION}")
    for field, reason in (
        ("model", "fingerprint"),
        ("fingerprint", "fingerprint"),
        ("layout", "layout"),
        ("dtype", "dtype"),
    ):
        if header.get(field) != getattr(fmt, field):
            raise BlockRefused(
                reason,
                f"block {to_hex(block_hash)} was written for {field}={header.get(field)!r}, this engine has "
                f"{getattr(fmt, field)!r}: engines sharing a store under one model name must run the same "
                "weights, dtype and block layout",
            )
    payload = blob[_HEAD.size + head_len :]
    if (
        header.get("hash") != to_hex(block_hash)
        or len(payload) != fmt.block_bytes
        or header.get("checksum") != checksum(payload)
    ):
        raise BlockRefused("checksum", f"block {to_hex(block_hash)} is corrupt (checksum or size mismatch)")
    return payload


class BlockStore(Protocol):
    async def put(self, fmt: BlockFormat, blocks: Sequence[tuple[BlockHash, bytes]]) -> int:
        """Store blocks not stored yet; returns how many were new."""

    async def get_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the longest run of `hashes`, from the first, that the store holds and that
        pass every check. A refused block ends the run (counted in `refused`)."""

    async def contains_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> int: ...

    async def stats(self) -> dict: ...


# The keys of one shard that its scripts name, in KEYS order; block keys follow them. Every key a
# script touches is in KEYS (so Redis Cluster checks they share the slot), except the LRU victims
# `_PUT` pops, which are block keys of the same shard and so of the same slot.
_META = ("cap", "clock", "lru", "sizes", "bytes", "evictions")

# KEYS: the shard's _META keys, then the block keys. ARGV: the shard's default cap, then one blob
# per block key. Returns {stored, evicted}.
# `sizes` is the ledger: a key counts in `bytes` exactly while it has a `sizes` entry, even if the
# key itself vanished behind our back (DEL by hand, Redis maxmemory eviction).
_PUT = Script("""
local CAP, CLOCK, LRU, SIZES, BYTES, EVICTIONS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local cap = tonumber(redis.call('GET', CAP) or ARGV[1])
local stored = 0
for i = 7, #KEYS do
  local k, v = KEYS[i], ARGV[i - 5]
  local tick = redis.call('INCR', CLOCK)
  if redis.call('EXISTS', k) == 0 then
    local stale = tonumber(redis.call('HGET', SIZES, k) or '0')
    redis.call('SET', k, v)
    redis.call('HSET', SIZES, k, #v)
    redis.call('INCRBY', BYTES, #v - stale)
    stored = stored + 1
  end
  redis.call('ZADD', LRU, tick, k)
end
local evicted = 0
while tonumber(redis.call('GET', BYTES) or '0') > cap do
  local victim = redis.call('ZPOPMIN', LRU)
  if #victim == 0 then
    redis.call('SET', BYTES, 0)
    break
  end
  local size = tonumber(redis.call('HGET', SIZES, victim[1]) or '0')
  redis.call('DEL', victim[1])
  redis.call('HDEL', SIZES, victim[1])
  redis.call('DECRBY', BYTES, size)
  evicted = evicted + 1
end
if evicted > 0 then redis.call('INCRBY', EVICTIONS, evicted) end
return {stored, evicted}
""")

# KEYS: clock, lru, then block keys of one shard in run order. Returns the blobs of the leading
# run of present keys (each touched in the LRU).
_GET_RUN = Script("""
local out = {}
for i = 3, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if not v then break end
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[1]), KEYS[i])
  out[#out + 1] = v
end
return out
""")

# KEYS: sizes, bytes, lru, the block key. Deletes one block and its accounting (a corrupt block).
_DROP = Script("""
local SIZES, BYTES, LRU, k = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local size = tonumber(redis.call('HGET', SIZES, k) or '0')
redis.call('DEL', k)
redis.call('DECRBY', BYTES, size)
redis.call('HDEL', SIZES, k)
redis.call('ZREM', LRU, k)
return size
""")


class RedisBlockStore:
    """`BlockStore` in Redis or a Redis Cluster, under a byte cap with LRU eviction, in
    STORE_SHARDS shards (one Lua call per shard an operation touches; see the module docstring).

    `client` is a redis.asyncio Redis or RedisCluster (common.redis_client.connect); `default_cap`
    is the total cap the shards use while Redis holds none (`set_cap` writes it)."""

    def __init__(self, client, prefix: str = STORE_PREFIX, default_cap: int = DEFAULT_CAP_BYTES) -> None:
        self.client = client
        self._prefix = prefix
        self._default_caps = shard_caps(default_cap)
        self._slots = SlotPipelines(client)
        self.refused: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0, **kwargs) -> RedisBlockStore:
        """redis://... for one Redis, redis+cluster://... for a Redis Cluster."""
        return cls(connect(url, timeout), **kwargs)

    def _meta(self, shard: int, name: str) -> str:
        return shard_prefix(shard, self._prefix) + name

    def _shard_keys(self, shard: int, *names: str) -> tuple[str, ...]:
        return tuple(self._meta(shard, name) for name in names)

    def _all(self, name: str) -> list[str]:
        return [self._meta(shard, name) for shard in range(STORE_SHARDS)]

    async def _run(self, calls: list[Call]) -> list:
        from redis.exceptions import RedisClusterException, RedisError

        try:
            return await self._slots.run(calls)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            raise BlockStoreUnavailable(
                f"shared block store in Redis unavailable: {type(exc).__name__}: {exc}"
            ) from exc

    async def set_cap(self, cap_bytes: int) -> None:
        """The total cap, split over the shards (`shard_caps`)."""
        await self._run(
            [Call(key, ("SET", key, cap)) for key, cap in zip(self._all("cap"), shard_caps(cap_bytes), strict=True)]
        )

    @staticmethod
    def _by_shard(hashes: Sequence[BlockHash]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, block_hash in enumerate(hashes):
            groups.setdefault(store_shard(block_hash), []).append(i)
        return groups

    async def put(self, fmt: BlockFormat, blocks: Sequence[tuple[BlockHash, bytes]]) -> int:
        if not blocks:
            return 0
        encoded = [(fmt.key(h, self._prefix), encode_block(fmt, h, payload)) for h, payload in blocks]
        calls = []
        for shard, idx in self._by_shard([block_hash for block_hash, _ in blocks]).items():
            meta = self._shard_keys(shard, *_META)
            calls.append(
                Call(
                    meta[0],
                    (self._default_caps[shard], *(encoded[i][1] for i in idx)),
                    script=_PUT,
                    keys=(*meta, *(encoded[i][0] for i in idx)),
                )
            )
        replies = await self._run(calls)
        return sum(int(stored) for stored, _evicted in replies)

    async def get_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> list[bytes]:
        if not hashes:
            return []
        keys = [fmt.key(h, self._prefix) for h in hashes]
        groups = self._by_shard(hashes)
        calls = [
            Call(
                self._meta(shard, "lru"),
                (),
                script=_GET_RUN,
                keys=(*self._shard_keys(shard, "clock", "lru"), *(keys[i] for i in idx)),
            )
            for shard, idx in groups.items()
        ]
        found: dict[int, bytes] = {}
        for idx, blobs in zip(groups.values(), await self._run(calls), strict=True):
            found.update(zip(idx, blobs, strict=False))  # each shard's leading run
        out = []
        for i, (block_hash, key) in enumerate(zip(hashes, keys, strict=True)):
            blob = found.get(i)
            if blob is None:  # the run ends at its first missing block
                break
            try:
                out.append(decode_block(fmt, block_hash, blob))
            except BlockRefused as exc:
                self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                log.error("refused a shared KV block: %s", exc, extra={"reason": exc.reason, "key": key})
                # Our key, yet not our block: corrupt, or a misconfigured writer. Either way no
                # reader with this format can use it, so it goes.
                shard = store_shard(block_hash)
                drop = Call(key, (), script=_DROP, keys=(*self._shard_keys(shard, "sizes", "bytes", "lru"), key))
                await self._run([drop])
                break
        return out

    async def contains_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> int:
        if not hashes:
            return 0
        keys = [fmt.key(h, self._prefix) for h in hashes]
        found = await self._run([Call(key, ("EXISTS", key)) for key in keys])
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    async def stats(self) -> dict:
        """Totals over the shards; `cap_bytes` is the sum of the shard caps (the total cap set)."""
        calls = []
        for shard in range(STORE_SHARDS):
            used, cap, evictions, lru = self._shard_keys(shard, "bytes", "cap", "evictions", "lru")
            calls += [Call(lru, ("MGET", used, cap, evictions)), Call(lru, ("ZCARD", lru))]
        replies = await self._run(calls)
        totals = {"bytes": 0, "cap_bytes": 0, "blocks": 0, "evictions": 0}
        for shard in range(STORE_SHARDS):
            (used, cap, evictions), blocks = replies[2 * shard], replies[2 * shard + 1]
            totals["bytes"] += int(used or 0)
            totals["cap_bytes"] += int(cap) if cap is not None else self._default_caps[shard]
            totals["blocks"] += int(blocks)
            totals["evictions"] += int(evictions or 0)
        return totals

    async def close(self) -> None:
        await self._slots.close()
        await self.client.aclose()
