"""MemoryIndex: the `Index` contract in one process's memory (tests, single-process set-ups)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope, Tier
from kvharbor.kvcache_service.index import (
    FORGET_TTL_S,
    FORGOTTEN,
    InstanceInfo,
    StreamEvent,
    joined_chain,
    stream_position,
)

Holder = tuple[Tier, str]  # (tier, instance)


class MemoryIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holders: dict[str, dict[BlockHash, set[Holder]]] = defaultdict(lambda: defaultdict(set))
        self._held: dict[tuple[str, Tier, str], set[BlockHash]] = defaultdict(set)
        self._registered: dict[tuple[str, str], str] = {}  # (model, instance) -> lease of its events
        self._leases: dict[tuple[str, str], tuple[str, float]] = {}  # -> (lease, deadline)
        self._cursors: dict[str, tuple[int, int]] = {}
        self._block_sizes: dict[str, int] = {}

    async def apply(self, events: Sequence[EventEnvelope | StreamEvent], fence: str | None = None) -> int:
        del fence  # one process: there is no shared stream ownership to check
        applied = 0
        for item in events:
            if isinstance(item, StreamEvent):
                pos = stream_position(item.entry_id)
                if item.stream in self._cursors and pos <= self._cursors[item.stream]:
                    continue
                self._cursors[item.stream] = pos
                item = item.envelope
            applied += self._apply_one(item)
        return applied

    def _apply_one(self, env: EventEnvelope) -> bool:
        key = (env.model, env.instance)
        live = self._leases.get(key)
        if live is not None and live[1] > self._clock() and live[0] != env.lease:
            return False  # a previous life's event: the instance runs under another lease now
        if self._registered.get(key) != env.lease:
            self._clear(env.model, env.instance)
            self._registered[key] = env.lease
        event = env.event
        if isinstance(event, BlockStored):
            self._block_sizes[env.model] = event.block_size
            held = self._held[(env.model, event.tier, env.instance)]
            for h in event.hashes:
                self._holders[env.model][h].add((event.tier, env.instance))
                held.add(h)
        elif isinstance(event, BlockRemoved):
            held = self._held[(env.model, event.tier, env.instance)]
            for h in event.hashes:
                self._drop_holder(env.model, h, (event.tier, env.instance))
                held.discard(h)
        elif isinstance(event, AllCleared):
            self._clear(env.model, env.instance)
        return True

    def _drop_holder(self, model: str, block_hash: BlockHash, holder: Holder) -> None:
        holders = self._holders[model].get(block_hash)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._holders[model][block_hash]

    def _clear(self, model: str, instance: str) -> None:
        for tier in ("device", "shared"):
            for h in self._held.pop((model, tier, instance), ()):
                self._drop_holder(model, h, (tier, instance))

    def _alive(self, model: str, instance: str) -> bool:
        lease = self._leases.get((model, instance))
        return lease is not None and lease[1] > self._clock() and self._registered.get((model, instance)) == lease[0]

    async def lookup(
        self,
        model: str,
        block_hashes: Sequence[BlockHash],
        instances: Sequence[str] | None = None,
        tier: Tier = "device",
    ) -> dict[str, int]:
        joined_chain(block_hashes)  # the same refusal of a malformed hash as RedisIndex
        wanted = set(instances) if instances is not None else None
        counts: dict[str, int] = {}
        holders = self._holders.get(model, {})
        first = holders.get(block_hashes[0], ()) if block_hashes else ()
        still = {
            inst for (t, inst) in first if t == tier and (wanted is None or inst in wanted) and self._alive(model, inst)
        }
        for j, h in enumerate(block_hashes):
            held = {inst for (t, inst) in holders.get(h, ()) if t == tier}
            for inst in still - held:
                counts[inst] = j
            still &= held
            if not still:
                break
        for inst in still:
            counts[inst] = len(block_hashes)
        return counts

    async def renew(self, model: str, instance: str, lease: str, ttl: float) -> None:
        self._leases[(model, instance)] = (lease, self._clock() + ttl)

    async def instances(self) -> list[InstanceInfo]:
        return [
            InstanceInfo(m, inst, lease, self._alive(m, inst), len(self._held.get((m, "device", inst), ())))
            for (m, inst), lease in sorted(self._registered.items())
        ]

    async def expire(self) -> list[tuple[str, str]]:
        dead = [key for key in self._registered if not self._alive(*key)]
        for model, instance in dead:
            self._clear(model, instance)
            del self._registered[(model, instance)]
        for key in [k for k, (_, deadline) in self._leases.items() if deadline <= self._clock()]:
            del self._leases[key]
        return sorted(dead)

    async def forget(self, model: str, instances: Sequence[str], ttl: float = FORGET_TTL_S) -> int:
        known = 0
        for instance in instances:
            self._clear(model, instance)
            known += self._registered.pop((model, instance), None) is not None
            self._leases[(model, instance)] = (FORGOTTEN, self._clock() + ttl)
        return known

    async def block_size(self, model: str) -> int | None:
        return self._block_sizes.get(model)

    async def close(self) -> None:
        pass
