"""Event intake through per-engine streams shared by several consumers, on a real redis-server and
on a real Redis Cluster: a consumer that dies between applying and acknowledging is replaced
without losing or double-applying anything; replicas split the streams and hand them over;
a stale owner cannot apply; a write-ahead record left half-done is replayed; malformed entries
are skipped and counted."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random

import pytest
from kv_event_writer import FakeEngine, chains, random_events

from kvharbor.common.kv_events import BlockStored, EventEnvelope, to_fields
from kvharbor.common.redis_client import Call, connect, connect_sync
from kvharbor.common.redis_keys import INDEX_PREFIX, resync_key, stream_key
from kvharbor.kvcache_service.consumer import EventConsumer, Ring
from kvharbor.kvcache_service.index import IndexUnavailable
from kvharbor.kvcache_service.index_scripts import SHARDS
from kvharbor.kvcache_service.layout_migration import LAYOUT, LayoutMigration
from kvharbor.kvcache_service.memory_index import MemoryIndex
from kvharbor.kvcache_service.redis_index import RedisIndex

MODEL = "intake-model"


async def same_state(index, reference, all_hashes) -> None:
    """Both indexes answer every single-block lookup alike, and hold the same instances."""
    assert [(i.instance, i.blocks) for i in await index.instances()] == [
        (i.instance, i.blocks) for i in await reference.instances()
    ]
    for h in all_hashes:
        assert await index.lookup(MODEL, [h]) == await reference.lookup(MODEL, [h])


def consumer(url: str, name: str, **kwargs) -> EventConsumer:
    options = {"batch": 50, "poll_ms": 10, "owner_ttl": 3.0, "rebalance_interval": 0.05} | kwargs
    return EventConsumer(connect(url, timeout=2), RedisIndex.from_url(url, timeout=2), consumer=name, **options)


async def close(*consumers: EventConsumer) -> None:
    for c in consumers:
        await c.stop()
        await c.client.aclose()
        await c.index.close()


async def steps(n: int, *consumers: EventConsumer) -> None:
    for _ in range(n):
        for c in consumers:
            await c.step()


def fleet(url: str, n: int, rounds: int, seed: int) -> tuple[list[FakeEngine], list, list]:
    """`n` alive fake engines that published `rounds` random batches between them."""
    sync = connect_sync(url, timeout=2)
    rng = random.Random(seed)
    cs = chains(MODEL, 6, 8)
    engines = [FakeEngine(sync, MODEL, f"e{i}") for i in range(n)]
    envelopes = []
    for _ in range(rounds):
        engine = rng.choice(engines)
        envelopes += engine.publish(*random_events(rng, MODEL, cs, 3))
    for engine in engines:
        engine.heartbeat()
    return engines, envelopes, cs


async def reference_of(engines, envelopes) -> MemoryIndex:
    reference = MemoryIndex()
    await reference.apply(envelopes)
    for engine in engines:
        await reference.renew(MODEL, engine.instance, engine.lease, 60)
    return reference


class DiesBeforeAck(Exception):
    pass


@pytest.mark.slow
def test_consumer_dies_between_apply_and_ack_and_a_new_one_resumes(any_redis):
    engines, envelopes, cs = fleet(any_redis.url, 3, 100, seed=7)
    sync = connect_sync(any_redis.url, timeout=2)
    sync.xadd(engines[0].stream, {"v": "1", "type": "stored", "body": "{not json"})  # malformed
    sync.xadd(
        engines[1].stream,
        {"v": "99", "type": "cleared", "instance": "e1", "model": MODEL, "lease": "x", "seq": "1", "body": "{}"},
    )

    async def main():
        reference = await reference_of(engines, envelopes)
        first = consumer(any_redis.url, "first")
        rounds, unacked = 0, 0
        real_apply = first.index.apply

        async def apply(events, fence=None):
            nonlocal rounds, unacked
            done = await real_apply(events, fence)
            rounds += 1
            if rounds == 3:
                unacked = len(events)
                raise DiesBeforeAck  # the third batch was applied, never acknowledged
            return done

        first.index.apply = apply
        with pytest.raises(DiesBeforeAck):
            await steps(20, first)
        # The dead replica neither renews nor releases: its ownership lapses (here: at once).
        for model, instance in first.streams.values():
            sync.delete(first.index.own_key(model, instance))
        sync.zrem(first.members_key, "first")
        second = consumer(any_redis.url, "second")
        await steps(10, second)
        assert second.stats.claimed >= unacked > 0
        assert second.stats.duplicates == unacked  # the unacknowledged batch is not applied again
        applied_by_first = first.stats.applied + unacked
        assert applied_by_first + second.stats.applied == len(envelopes)
        # Each malformed entry was counted by whoever read it (twice if it sat in the lost batch).
        assert set(first.stats.malformed + second.stats.malformed) == {"invalid", "version"}
        for engine in engines:
            assert sync.xpending(engine.stream, second.group)["pending"] == 0
        await same_state(second.index, reference, [h for c in cs for h in c])
        await close(second)
        await first.client.aclose()
        await first.index.close()

    asyncio.run(main())


@pytest.mark.slow
def test_replicas_split_the_streams_and_hand_them_over(any_redis):
    engines, envelopes, cs = fleet(any_redis.url, 12, 120, seed=11)

    async def main():
        reference = await reference_of(engines, envelopes)
        # Rebalancing every step makes the hand-over a matter of rounds, not of how fast a round
        # runs: with a 50 ms interval, four quick rounds could end before b looked again (a CI flake).
        a, b = consumer(any_redis.url, "a", rebalance_interval=0), consumer(any_redis.url, "b", rebalance_interval=0)
        await steps(1, a, b)  # a takes every stream before b joins; b finds them held
        assert len(a.streams) == 12 and not b.streams
        await steps(2, a, b)  # a gives b its share of the ring, and b takes it
        assert a.streams and b.streams and not set(a.streams) & set(b.streams)
        assert set(a.streams) | set(b.streams) == {e.stream for e in engines}
        ring = Ring(["a", "b"])
        assert all(ring.owner(s) == "a" for s in a.streams)
        assert a.stats.applied + b.stats.applied == len(envelopes)  # each event once, by one of them
        assert a.stats.duplicates + b.stats.duplicates == 0
        await same_state(a.index, reference, [h for c in cs for h in c])
        await a.stop()  # a graceful stop hands its streams back at once
        more = engines[0].publish(engines[0].stored(cs[0]))
        await steps(1, b)
        assert set(b.streams) == {e.stream for e in engines}
        assert b.stats.applied + a.stats.applied == len(envelopes) + len(more)
        await close(b)
        await a.client.aclose()
        await a.index.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_stale_owner_cannot_apply(any_redis):
    engines, _, cs = fleet(any_redis.url, 1, 0, seed=1)
    engines[0].publish(engines[0].stored(cs[0]))

    async def main():
        stale = consumer(any_redis.url, "stale")
        await stale._rebalance()  # owns the stream; the entry is still new
        (model, instance) = stale.streams[engines[0].stream]
        await stale.client.set(stale.index.own_key(model, instance), "someone-else")  # it stalled; taken over
        await stale._read_new()
        assert stale.stats.applied == 0 and not stale.streams  # nothing applied; the stream is dropped
        assert await stale.index.instances() == []
        pending = await stale.client.xpending(engines[0].stream, stale.group)
        assert pending["pending"] == 1  # left for the new owner to claim
        await close(stale)

    asyncio.run(main())


@pytest.mark.slow
def test_undecodable_bytes_make_one_entry_malformed_not_the_intake_dead(any_redis):
    sync = connect_sync(any_redis.url, timeout=2)
    engine = FakeEngine(sync, MODEL, "e0")
    engine.heartbeat()
    hashes = chains(MODEL, 1, 4)[0]
    engine.publish(engine.stored(hashes[:2]))
    sync.xadd(engine.stream, {"v": "1", "type": "cleared", "instance": b"\xff\xfe", "model": MODEL, "body": "{}"})
    engine.publish(engine.stored(hashes[2:]))

    async def main():
        c = consumer(any_redis.url, "c")
        await steps(3, c)
        assert c.stats.applied == 2 and sum(c.stats.malformed.values()) == 1
        assert await c.index.lookup(MODEL, hashes) == {"e0": 4}
        await close(c)

    asyncio.run(main())


@pytest.mark.slow
def test_a_half_applied_batch_is_replayed_by_the_next_writer(any_redis):
    """A consumer died after the instance's script wrote its ops (step A) and before the shards
    got them (B): the next apply for that instance finishes them first, so nothing is lost."""
    sync = connect_sync(any_redis.url, timeout=2)
    engine = FakeEngine(sync, MODEL, "e0")
    engine.heartbeat()
    h = chains(MODEL, 1, 6)[0]

    async def main():
        index = RedisIndex.from_url(any_redis.url, timeout=2)

        async def dies(*args):
            raise DiesBeforeAck

        index._finish = dies
        with pytest.raises(DiesBeforeAck):
            await index.apply([engine.envelope(engine.stored(h[:4]))])
        await index.close()
        index = RedisIndex.from_url(any_redis.url, timeout=2)
        assert await index.lookup(MODEL, h) == {}  # the shards never got the blocks
        await index.apply([engine.envelope(engine.stored(h[4:]))])  # replays the record, then applies
        assert await index.lookup(MODEL, h) == {"e0": 6}
        assert [(i.instance, i.blocks) for i in await index.instances()] == [("e0", 6)]
        await index.close()

    asyncio.run(main())


@pytest.mark.slow
def test_lookup_cost_does_not_grow_with_engines_that_do_not_hold_the_prompt(any_redis):
    """200 engines hold other chains; a lookup reads at most one command per shard, plus one
    lease per holder it found."""
    sync = connect_sync(any_redis.url, timeout=2)
    prompt = chains(MODEL, 1, 64, salt="prompt")[0]
    others = chains(MODEL, 20, 64, salt="others")
    engines = [FakeEngine(sync, MODEL, f"e{i}") for i in range(200)]

    async def main():
        index = RedisIndex.from_url(any_redis.url, timeout=2)
        events = []
        for i, engine in enumerate(engines):
            engine.heartbeat()
            events.append(engine.envelope(engine.stored(others[i % 20])))
        events += [engines[0].envelope(engines[0].stored(prompt)), engines[1].envelope(engines[1].stored(prompt[:9]))]
        await index.apply(events)
        sent: list[Call] = []
        real_run = index._slots.run

        async def counting(calls, raise_on_error=True):
            sent.extend(calls)
            return await real_run(calls, raise_on_error)

        index._slots.run = counting
        assert await index.lookup(MODEL, prompt) == {"e0": 64, "e1": 9}
        assert len(sent) <= SHARDS + 1 + 2  # the shards, the holders' names (first time), two leases
        sent.clear()
        assert await index.lookup(MODEL, prompt) == {"e0": 64, "e1": 9}
        assert len(sent) <= SHARDS + 2  # names are cached: they never change meaning
        await index.close()

    asyncio.run(main())


@pytest.mark.slow
def test_an_index_written_in_another_layout_makes_the_engines_resync(any_redis):
    """Blocks indexed under another key layout (an upgrade moved them) are unreadable: the first
    replica to see it, before it applies anything, bumps the resync counter once, so every engine
    re-publishes."""
    sync = connect_sync(any_redis.url, timeout=2)
    sync.set(INDEX_PREFIX + "layout", "1")
    engine = FakeEngine(sync, MODEL, "e0")
    engine.publish(engine.stored(chains(MODEL, 1, 4)[0]))
    engine.heartbeat()

    async def main():
        first, second = consumer(any_redis.url, "a"), consumer(any_redis.url, "b")
        try:
            await steps(2, first)  # claims before it applies the engine's events
            await steps(1, second)
            return first.stats.resyncs_requested, second.stats.resyncs_requested
        finally:
            await close(first, second)

    assert asyncio.run(main()) == (1, 0)
    assert sync.get(resync_key()) == b"1"
    assert sync.get(INDEX_PREFIX + "layout") == LAYOUT.encode()


@pytest.mark.slow
def test_the_leader_removes_an_older_layouts_keys_a_batch_per_sweep_and_nothing_else(any_redis, monkeypatch):
    """Layout 1's block shard keys (`:b:<bucket>`, `:b:m`), left by an upgrade, go a few SCAN pages
    per sweep, on every node; the index's own keys stay and still answer. A failed batch drops
    the pass and the mark stays, so a later sweep starts again; a pass that removes nothing ends it."""
    import kvharbor.kvcache_service.layout_migration as layout

    monkeypatch.setattr(layout, "OLD_SCAN_PAGE", 50)
    monkeypatch.setattr(layout, "OLD_PAGES_PER_SWEEP", 2)
    sync = connect_sync(any_redis.url, timeout=2)
    sync.set(INDEX_PREFIX + "layout", "1")
    old = [f"{INDEX_PREFIX}{{{m}:{t}{s:02d}}}:b:{b}" for m in ("m1", "m2") for t in "ds" for s in range(SHARDS)
           for b in (*range(0, 32768, 2731), "m")]  # fmt: skip
    for key in old:
        sync.hset(key, "h", "x")
    kept = [INDEX_PREFIX + k for k in ("{m1:d03}:b:x", "{m1}:holders", "{m1:e0}:b:1")] + ["other:{m1:d03}:b:1"]
    for key in kept:
        sync.set(key, "1")
    engine = FakeEngine(sync, MODEL, "e0")
    prompt = chains(MODEL, 1, 4)[0]
    engine.publish(engine.stored(prompt))
    engine.heartbeat()

    async def main():
        c = consumer(any_redis.url, "a", sweep_interval=0.0)
        failed = []
        real_unlink = c.layout.unlink

        async def unlink_failing_once(keys):
            if not failed and c.stats.old_layout_removed >= 100:
                failed.append(len(keys))
                raise IndexUnavailable("injected")
            return await real_unlink(keys)

        c.layout.unlink = unlink_failing_once
        try:
            await steps(1, c)  # claims the layout (a resync) and applies the engine's events
            for _ in range(200):
                with contextlib.suppress(IndexUnavailable):
                    await c.step()
                if c.stats.old_layout_removed and not sync.exists(INDEX_PREFIX + "layout:old"):
                    break
            return c.stats.old_layout_removed, failed, await c.index.lookup(MODEL, prompt)
        finally:
            await close(c)

    removed, failed, found = asyncio.run(main())
    assert len(failed) == 1 and failed[0] > 0  # one page's batch failed: its pass started over
    assert removed == len(old) and not any(sync.exists(k) for k in old)
    assert all(sync.exists(k) for k in kept) and found == {"e0": 4}
    assert not sync.exists(INDEX_PREFIX + "layout:old") and sync.get(INDEX_PREFIX + "layout") == LAYOUT.encode()


@pytest.mark.slow
def test_a_new_redis_gets_the_layout_named_without_a_resync(any_redis):
    async def main():
        index = RedisIndex.from_url(any_redis.url, timeout=2)
        try:
            return await LayoutMigration(index).claim(), await LayoutMigration(index).claim()
        finally:
            await index.close()

    assert asyncio.run(main()) == (False, False)
    sync = connect_sync(any_redis.url, timeout=2)
    assert sync.get(INDEX_PREFIX + "layout") == LAYOUT.encode() and sync.get(resync_key()) is None
    sync.delete(INDEX_PREFIX + "layout")  # as written before layouts were named, with an instance in it
    engine = FakeEngine(sync, MODEL, "e0")
    engine.heartbeat()

    async def old():
        index = RedisIndex.from_url(any_redis.url, timeout=2)
        try:
            await index.apply([engine.envelope(engine.stored(chains(MODEL, 1, 2)[0]))])
            sync.delete(INDEX_PREFIX + "layout")
            return await LayoutMigration(index).claim()
        finally:
            await index.close()

    assert asyncio.run(old()) is True


@pytest.mark.slow
def test_engines_that_publish_before_the_first_replica_starts_cause_no_resync(any_redis):
    sync = connect_sync(any_redis.url, timeout=2)
    engine = FakeEngine(sync, MODEL, "e0")
    h = chains(MODEL, 1, 4)[0]
    engine.publish(engine.stored(h))
    engine.heartbeat()

    async def main():
        c = consumer(any_redis.url, "a")
        try:
            await steps(3, c)
            return c.stats.resyncs_requested, await c.index.lookup(MODEL, h)
        finally:
            await close(c)

    assert asyncio.run(main()) == (0, {"e0": 4})
    assert sync.get(resync_key()) is None


def test_the_ring_moves_few_streams_when_a_member_joins():
    streams = [stream_key(MODEL, f"e{i}") for i in range(1000)]
    before = Ring(["a", "b", "c"])
    after = Ring(["a", "b", "c", "d"])
    moved = [s for s in streams if before.owner(s) != after.owner(s)]
    assert all(after.owner(s) == "d" for s in moved)  # streams only move to the newcomer
    assert 150 < len(moved) < 350  # about a quarter
    share = {m: sum(after.owner(s) == m for s in streams) for m in "abcd"}
    assert min(share.values()) > 150  # no member starves
    assert Ring([]).owner(streams[0]) is None


def test_a_batch_is_applied_with_the_cyclic_collector_paused_and_it_comes_back_on_failure():
    """The collector kept traversing a batch's live events (a third of the intake's Python time at
    a thousand streams): it is off while a batch applies, and back on after, even when it fails."""
    seen = []

    class Index:
        async def apply(self, events, fence=None):
            seen.append((len(events), gc.isenabled()))
            raise ConnectionError("Redis went away mid-batch")

    c = EventConsumer(object(), Index(), consumer="x")
    c.streams = {"s": (MODEL, "e0")}
    fields = to_fields(EventEnvelope(BlockStored((bytes(16),), None, 16), "e0", MODEL, "lease", 1))
    raw = [x.encode() for kv in fields.items() for x in kv]
    assert gc.isenabled()
    with pytest.raises(ConnectionError):
        asyncio.run(c._process({"s": [(b"1-0", raw)]}))
    assert seen == [(1, False)] and gc.isenabled()
