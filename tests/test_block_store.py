"""The shared KV block store on a real redis-server and on a real 3-master Redis Cluster: runs, LRU
under a byte cap (per shard), blocks spread over the shards, refusals, and on the cluster that
every key sits on its shard's slot."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import re

import pytest

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.redis_client import connect, connect_sync
from kvharbor.kvcache_service.block_store import (
    STORE_SHARDS,
    BlockFormat,
    BlockRefused,
    BlockStoreUnavailable,
    RedisBlockStore,
    decode_block,
    encode_block,
    shard_caps,
    store_shard,
)
from kvharbor.kvcache_service.reuse_stats import FIELDS, read_all, record

FMT = BlockFormat(model="m", fingerprint="fp-1", layout="hm1:L2:H1:D4:B4", dtype="bfloat16", block_bytes=64)
HASHES = block_hashes(list(range(40)), 4, "m")  # 10 blocks, over several shards
SIZE = len(encode_block(FMT, HASHES[0], bytes(FMT.block_bytes)))  # one stored blob, header and all


def in_shard(shard: int, n: int) -> list[bytes]:
    """`n` distinct 16-byte block hashes that all land in `shard`."""
    return [bytes([shard]) + hashlib.blake2b(str(i).encode(), digest_size=15).digest() for i in range(n)]


ONE = in_shard(5, 4)  # blocks of one shard, for the tests of one shard's LRU and ledger


def payload(i: int) -> bytes:
    return bytes([i % 256]) * FMT.block_bytes


def run(redis_url: str, body, **store_kwargs) -> None:
    async def main():
        client = connect(redis_url, timeout=2)
        store = RedisBlockStore(client, **store_kwargs)
        try:
            await body(store, client)
        finally:
            await store.close()

    asyncio.run(main())


def test_shards_and_caps():
    assert len({store_shard(h) for h in HASHES}) > 1
    assert {store_shard(h) for h in ONE} == {5}
    key = FMT.key(ONE[0])
    assert key.startswith("kvharbor:blk:{s05}:m:hm1:L2:H1:D4:B4:bfloat16:fp-1:")
    assert shard_caps(16 * 3 + 5) == [4] * 5 + [3] * 11 and sum(shard_caps(12345)) == 12345


@pytest.mark.slow  # a real redis-server
def test_put_then_get_longest_run(any_redis):
    async def body(store, _client):
        assert await store.put(FMT, [(HASHES[i], payload(i)) for i in (0, 1, 2, 4)]) == 4
        assert await store.put(FMT, [(HASHES[0], payload(0))]) == 0  # already there
        assert await store.get_run(FMT, HASHES) == [payload(0), payload(1), payload(2)]
        assert await store.contains_run(FMT, HASHES) == 3
        assert await store.get_run(FMT, HASHES[3:]) == []
        assert await store.contains_run(FMT, HASHES[3:]) == 0
        for field, value in (("layout", "hm1:L2:H1:D4:B8"), ("dtype", "float16"), ("fingerprint", "fp-2")):
            other = dataclasses.replace(FMT, **{field: value})  # another key space: no refusals, no hits
            assert await store.get_run(other, HASHES) == []
        assert store.refused == {}
        stats = await store.stats()
        assert stats == {"bytes": 4 * SIZE, "cap_bytes": 1 << 30, "blocks": 4, "evictions": 0}

    run(any_redis.url, body)


@pytest.mark.slow  # a real redis-server
def test_byte_cap_evicts_least_recently_used(any_redis):
    async def body(store, _client):
        await store.set_cap(STORE_SHARDS * 3 * SIZE)  # three blocks a shard
        await store.put(FMT, [(ONE[i], payload(i)) for i in range(3)])
        assert await store.get_run(FMT, ONE[:1]) == [payload(0)]  # block 0 is now the most recent
        await store.put(FMT, [(ONE[3], payload(3))])  # evicts block 1, the least recently used
        assert await store.contains_run(FMT, ONE[:1]) == 1
        assert await store.contains_run(FMT, ONE[1:2]) == 0
        assert await store.contains_run(FMT, ONE[2:4]) == 2
        stats = await store.stats()
        assert stats == {"bytes": 3 * SIZE, "cap_bytes": STORE_SHARDS * 3 * SIZE, "blocks": 3, "evictions": 1}

    run(any_redis.url, body)


@pytest.mark.slow  # a real redis-server
def test_blocks_spread_over_shards_under_the_total_cap(any_redis):
    hashes = block_hashes(list(range(4 * 400)), 4, "m")  # 400 blocks
    cap = STORE_SHARDS * 10 * SIZE + 7  # room for 160 blocks in all, 10 a shard

    async def body(store, client):
        await store.set_cap(cap)
        for start in range(0, len(hashes), 50):
            await store.put(FMT, [(h, payload(i)) for i, h in enumerate(hashes[start : start + 50], start)])
        stats = await store.stats()
        assert stats["cap_bytes"] == cap
        assert stats["bytes"] <= cap and stats["bytes"] == stats["blocks"] * SIZE
        assert stats["evictions"] == len(hashes) - stats["blocks"]
        # Every shard took part and none holds more than its share of the cap.
        per_shard = [await client.zcard(f"kvharbor:blk:{{s{s:02d}}}:lru") for s in range(STORE_SHARDS)]
        assert all(n > 0 for n in per_shard) and sum(per_shard) == stats["blocks"]
        assert max(per_shard) * SIZE <= max(shard_caps(cap))
        # Uniform hashes fill (nearly) every shard to its cap.
        assert stats["blocks"] >= 150
        # The newest block of every shard survived, an evicted one reads as a miss.
        assert await store.get_run(FMT, hashes[-1:]) == [payload(len(hashes) - 1)]
        assert await store.contains_run(FMT, hashes) == 0

    run(any_redis.url, body)


@pytest.mark.slow  # a real redis-server
def test_accounting_survives_keys_vanishing_behind_its_back(any_redis):
    async def body(store, client):
        await store.put(FMT, [(ONE[0], payload(0))])
        await client.delete(FMT.key(ONE[0]))  # by hand, or Redis maxmemory eviction
        assert await store.put(FMT, [(ONE[0], payload(0))]) == 1
        stats = await store.stats()
        assert (stats["bytes"], stats["blocks"]) == (SIZE, 1)
        await store.set_cap(STORE_SHARDS * SIZE)  # one block a shard
        await client.delete(FMT.key(ONE[0]))
        await store.put(FMT, [(ONE[1], payload(1))])  # evicts the vanished one; the ledger follows
        stats = await store.stats()
        assert (stats["bytes"], stats["blocks"]) == (SIZE, 1)
        assert await store.get_run(FMT, ONE[1:2]) == [payload(1)]

    run(any_redis.url, body)


@pytest.mark.slow  # a real redis-server
def test_corrupt_block_is_refused_and_deleted(any_redis):
    async def body(store, client):
        await store.put(FMT, [(HASHES[i], payload(i)) for i in range(3)])
        key = FMT.key(HASHES[1])
        blob = bytearray(await client.get(key))
        blob[-1] ^= 0xFF
        await client.set(key, bytes(blob))
        assert await store.get_run(FMT, HASHES) == [payload(0)]  # the run ends at the corrupt block
        assert store.refused == {"checksum": 1}
        assert await client.exists(key) == 0
        stats = await store.stats()
        assert (stats["blocks"], stats["bytes"]) == (2, 2 * SIZE)  # its accounting went with it

    run(any_redis.url, body)


@pytest.mark.slow  # a real redis-server
@pytest.mark.parametrize(("field", "value"), [("fingerprint", "fp-2"), ("dtype", "float32"), ("model", "m2")])
def test_foreign_block_is_refused_loudly(any_redis, field, value, caplog):
    async def body(store, client):
        foreign = dataclasses.replace(FMT, **{field: value})
        # Written under our key by an engine with other weights, dtype or model name.
        await client.set(FMT.key(HASHES[0]), encode_block(foreign, HASHES[0], payload(0)))
        assert await store.get_run(FMT, HASHES) == []
        assert sum(store.refused.values()) == 1
        assert await client.exists(FMT.key(HASHES[0])) == 0  # not usable by anyone reading this key

    run(any_redis.url, body)
    assert "refused a shared KV block" in caplog.text


@pytest.mark.slow  # a real Redis Cluster
def test_every_key_sits_on_its_shards_slot_on_the_cluster(redis_cluster):
    import redis

    redis_cluster.flush()
    hashes = block_hashes(list(range(4 * 64)), 4, "m")

    async def body(store, client):
        await store.set_cap(STORE_SHARDS * 20 * SIZE)
        await store.put(FMT, [(h, payload(i)) for i, h in enumerate(hashes)])
        await store.set_cap(STORE_SHARDS * 2 * SIZE)
        await store.put(FMT, [(h, payload(i)) for i, h in enumerate(hashes)])  # evicts in every shard
        await store.get_run(FMT, hashes)
        await client.set(FMT.key(hashes[-1]), b"junk")
        assert await store.get_run(FMT, hashes[-1:]) == []  # a drop
        stats = await store.stats()
        assert stats["evictions"] > 0 and stats["blocks"] <= STORE_SHARDS * 2

    run(redis_cluster.url, body)

    tag = re.compile(r"^kvharbor:blk:(\{s\d\d\}):")
    slots_of_shard: dict[str, set[int]] = {}
    nodes_of_shard: dict[str, set[int]] = {}
    with connect_sync(redis_cluster.url, timeout=2) as cluster:
        for port in redis_cluster.ports:
            with redis.Redis(port=port, socket_timeout=2) as node:
                for raw in node.scan_iter(count=1000):
                    key = raw.decode()
                    match = tag.match(key)
                    assert match, f"{key} is no shard key of the store"
                    assert cluster.get_node_from_key(key).port == port, f"{key} is not on the node owning its slot"
                    slots_of_shard.setdefault(match[1], set()).add(cluster.keyslot(key))
                    nodes_of_shard.setdefault(match[1], set()).add(port)
    assert len(slots_of_shard) == STORE_SHARDS  # every shard holds keys...
    assert all(len(s) == 1 for s in slots_of_shard.values())  # ...all on one slot (its scripts' keys)
    assert len({n for nodes in nodes_of_shard.values() for n in nodes}) > 1  # and the shards spread over nodes


@pytest.mark.slow  # a real redis-server
def test_reuse_counters_are_read_from_every_node(any_redis):
    async def main():
        client = connect(any_redis.url, timeout=2)
        try:
            for i in range(20):
                await record(client, f"model-{i}", {"requests_miss": i + 1, "blocks_computed": 2})
            counters = await read_all(client)
        finally:
            await client.aclose()
        assert sorted(counters) == sorted(f"model-{i}" for i in range(20))
        assert all(set(c) == set(FIELDS) for c in counters.values())
        assert sorted(c["requests_miss"] for c in counters.values()) == list(range(1, 21))

    asyncio.run(main())


def test_decode_checks_hash_and_size():
    blob = encode_block(FMT, HASHES[0], payload(0))
    assert decode_block(FMT, HASHES[0], blob) == payload(0)
    with pytest.raises(BlockRefused) as err:
        decode_block(FMT, HASHES[1], blob)  # a block stored under the wrong hash
    assert err.value.reason == "checksum"
    with pytest.raises(BlockRefused):
        decode_block(FMT, HASHES[0], b"junk")
    with pytest.raises(ValueError, match="bytes"):
        encode_block(FMT, HASHES[0], os.urandom(3))


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_store_down_raises_typed_error(scheme):
    from servers import free_port

    async def main():
        store = RedisBlockStore.from_url(f"{scheme}://127.0.0.1:{free_port()}/0", timeout=0.5)
        for call in (store.get_run(FMT, HASHES), store.put(FMT, [(HASHES[0], payload(0))]), store.stats()):
            with pytest.raises(BlockStoreUnavailable):
                await call
        await store.close()

    asyncio.run(main())
