"""What an engine does on Redis, without an engine: XADD KV events, keep a lease key. For tests
and benchmarks of the KV cache service."""

from __future__ import annotations

import random

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope, KVEvent, to_fields
from kvharbor.common.redis_keys import lease_key, registry_value, stream_key, stream_registry_key


class FakeEngine:
    """One instance's side of the KV event contract, through a sync redis client (Redis or
    RedisCluster): its own stream, registered as an engine registers it."""

    def __init__(self, client, model: str, instance: str, lease: str | None = None) -> None:
        self.client, self.model, self.instance = client, model, instance
        self.lease = lease or f"{instance}-lease"
        self.seq = 0
        self.stream = stream_key(model, instance)
        client.hset(stream_registry_key(), self.stream, registry_value(model, instance))

    def heartbeat(self, ttl: float = 60.0) -> None:
        self.client.set(lease_key(self.model, self.instance), self.lease, px=int(ttl * 1000))

    def envelope(self, event: KVEvent) -> EventEnvelope:
        self.seq += 1
        return EventEnvelope(event, self.instance, self.model, self.lease, self.seq)

    def publish(self, *events: KVEvent) -> list[EventEnvelope]:
        envelopes = [self.envelope(e) for e in events]
        pipe = self.client.pipeline(transaction=False)
        for env in envelopes:
            pipe.xadd(self.stream, to_fields(env))
        pipe.execute()
        return envelopes

    def stored(self, hashes, parent=None, block_size: int = 16) -> BlockStored:
        return BlockStored(tuple(hashes), parent, block_size)


def random_events(rng: random.Random, model: str, chains: list[list[bytes]], n: int) -> list[KVEvent]:
    """A plausible mix: store chain prefixes, remove tails, now and then clear everything."""
    events: list[KVEvent] = []
    for _ in range(n):
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.6:
            k = rng.randint(1, len(chain))
            events.append(BlockStored(tuple(chain[:k]), None, 16))
        elif roll < 0.95:
            k = rng.randint(0, len(chain) - 1)
            events.append(BlockRemoved(tuple(chain[k:])))
        else:
            events.append(AllCleared())
    return events


def chains(model: str, count: int, blocks: int, salt: str | None = None) -> list[list[bytes]]:
    return [block_hashes(list(range(i * 10_000, i * 10_000 + blocks * 16)), 16, model, salt) for i in range(count)]
