"""Event intake through a Redis consumer group (real redis-server): a consumer that dies between
applying and acknowledging is replaced without losing or double-applying anything; malformed
entries are skipped and counted; a Redis restart is survived."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis
import redis.asyncio as aredis
from kv_event_writer import FakeEngine, chains, random_events

from kvharbor.common.redis_keys import stream_key
from kvharbor.kvcache_service.consumer import EventConsumer
from kvharbor.kvcache_service.index import LeadershipLost
from kvharbor.kvcache_service.memory_index import MemoryIndex
from kvharbor.kvcache_service.redis_index import RedisIndex

pytestmark = pytest.mark.slow  # a real redis-server

MODEL = "intake-model"


async def same_state(index, reference, all_hashes) -> None:
    """Both indexes answer every single-block lookup alike, and hold the same instances."""
    assert [(i.instance, i.blocks) for i in await index.instances()] == [
        (i.instance, i.blocks) for i in await reference.instances()
    ]
    for h in all_hashes:
        assert await index.lookup(MODEL, [h]) == await reference.lookup(MODEL, [h])


def engine_with_one_chain(redis_url: str, blocks: int = 4) -> tuple[FakeEngine, list[bytes]]:
    """An empty Redis with one alive fake engine that stored one chain of `blocks` blocks."""
    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()
    engine = FakeEngine(sync, MODEL, "e0")
    engine.heartbeat()
    hashes = chains(MODEL, 1, blocks)[0]
    engine.publish(engine.stored(hashes))
    return engine, hashes


class DiesBeforeAck(Exception):
    pass


def test_consumer_dies_between_apply_and_ack_and_a_new_one_resumes(redis_server):
    sync = redis.Redis.from_url(redis_server.url)
    sync.flushdb()
    rng = random.Random(7)
    cs = chains(MODEL, 6, 8)
    engines = [FakeEngine(sync, MODEL, f"e{i}") for i in range(3)]
    envelopes = []
    for _ in range(100):
        engine = rng.choice(engines)
        envelopes += engine.publish(*random_events(rng, MODEL, cs, 3))
    for engine in engines:
        engine.heartbeat()
    sync.xadd(stream_key(MODEL), {"v": "1", "type": "stored", "body": "{not json"})  # malformed
    sync.xadd(
        stream_key(MODEL),
        {"v": "99", "type": "cleared", "instance": "e0", "model": MODEL, "lease": "x", "seq": "1", "body": "{}"},
    )

    async def main():
        reference = MemoryIndex()
        await reference.apply(envelopes)
        for engine in engines:
            await reference.renew(MODEL, engine.instance, engine.lease, 60)

        client = aredis.from_url(redis_server.url)
        index = RedisIndex(aredis.from_url(redis_server.url))
        first = EventConsumer(client, index, consumer="first", batch=50, block_ms=50)
        acks = 0
        real_xack = client.xack

        async def xack(*args):
            nonlocal acks
            acks += 1
            if acks == 3:
                raise DiesBeforeAck  # the third batch was applied, never acknowledged
            return await real_xack(*args)

        client.xack = xack
        try:
            for _ in range(10):
                await first.step()
        except DiesBeforeAck:
            pass
        assert first.stats.applied == 150 and acks == 3
        client.xack = real_xack
        # A new replica: the dead one's lock lapses, then it claims the pending batch and goes on.
        await client.delete(first.lock_key)
        second = EventConsumer(client, index, consumer="second", batch=50, block_ms=50)
        for _ in range(10):
            await second.step()
        assert second.stats.claimed == 50
        assert second.stats.duplicates == 50  # the unacknowledged batch is not applied again
        assert first.stats.applied + second.stats.applied == len(envelopes) == 300
        assert dict(second.stats.malformed) == {"invalid": 1, "version": 1}
        pending = await client.xpending(stream_key(MODEL), second.group)
        assert pending["pending"] == 0
        await same_state(index, reference, [h for c in cs for h in c])
        await second.stop()
        await client.aclose()
        await index.close()

    asyncio.run(main())


def test_only_one_replica_consumes(redis_server):
    engine_with_one_chain(redis_server.url)

    async def main():
        client = aredis.from_url(redis_server.url)
        index = RedisIndex(aredis.from_url(redis_server.url))
        a = EventConsumer(client, index, consumer="a", block_ms=50)
        b = EventConsumer(client, index, consumer="b", block_ms=50, lock_ttl=0.3)
        await a.step()
        await b.step()
        assert a.stats.leader and not b.stats.leader
        assert a.stats.applied == 1 and b.stats.applied == 0
        await a.stop()  # releases the lock: b takes over
        await b.step()
        assert b.stats.leader
        await b.stop()
        await client.aclose()
        await index.close()

    asyncio.run(main())


def test_undecodable_bytes_make_one_entry_malformed_not_the_intake_dead(redis_server):
    sync = redis.Redis.from_url(redis_server.url)
    sync.flushdb()
    engine = FakeEngine(sync, MODEL, "e0")
    engine.heartbeat()
    hashes = chains(MODEL, 1, 4)[0]
    engine.publish(engine.stored(hashes[:2]))
    sync.xadd(stream_key(MODEL), {"v": "1", "type": "cleared", "instance": b"\xff\xfe", "model": MODEL, "body": "{}"})
    engine.publish(engine.stored(hashes[2:]))

    async def main():
        client = aredis.from_url(redis_server.url)
        index = RedisIndex(aredis.from_url(redis_server.url))
        consumer = EventConsumer(client, index, block_ms=50)
        for _ in range(3):
            await consumer.step()
        assert consumer.stats.applied == 2 and sum(consumer.stats.malformed.values()) == 1
        assert await index.lookup(MODEL, hashes) == {"e0": 4}
        await consumer.stop()
        await client.aclose()
        await index.close()

    asyncio.run(main())


def test_a_consumer_that_lost_the_lock_cannot_apply(redis_server):
    engine_with_one_chain(redis_server.url)

    async def main():
        client = aredis.from_url(redis_server.url)
        index = RedisIndex(aredis.from_url(redis_server.url))
        stale = EventConsumer(client, index, consumer="stale", block_ms=50)
        await stale._lead()
        await stale._discover()  # claims nothing yet; the entry is still new
        await client.set(stale.lock_key, "someone-else")  # it stalled; another replica took over
        with pytest.raises(LeadershipLost):  # a fenced apply does not go through without the lock
            await stale._read_new()
        assert stale.stats.applied == 0
        assert await index.instances() == []
        await client.aclose()
        await index.close()

    asyncio.run(main())
