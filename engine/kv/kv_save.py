"""KVSaveQueue: the engine thread's half of pushing KV blocks to the shared block store.

The block pool records which blocks to copy out, by the push policy it was built with
(`SAVE_ON`); they travel in the scheduler's plan, and the runner hands them to `save` before or
after its forward, in the engine thread (the KV tensor is only consistent there). `save` exports
them to bytes into a queue bounded in bytes: beyond it, blocks are dropped and counted. The
store client (kv_offload.KVStoreClient) takes batches off the queue in its asyncio task and writes
them to Redis. The pool, the runner and this queue are built together, at the core's start
(engine/core_parts.py), so a block filled by the first step is saved too.

Policies:
- `all`: every block this engine fills is copied out after the step that filled it (write-through).
- `hot` (serve's default): a prefix is copied out the first time it is reused here (a system
  prompt, a shared document: what other engines are likely to want), and blocks on eviction.
- `evict`: a cached block is copied out just before its slot is reused (write-back on eviction).
- `off`: never.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Literal

from kvharbor.common.block_hash import BlockHash
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.kv.block_pool import Save, SaveOn
from kvharbor.engine.kv.kv_transfer import KVBlockIO

log = logging.getLogger("kvharbor.engine.kv_store")
PushPolicy = Literal["all", "hot", "evict", "off"]
SAVE_ON: dict[str, frozenset[SaveOn]] = {
    "all": frozenset({"fill"}),  # write-through: every block the forward fills
    "hot": frozenset({"reuse", "evict"}),  # a prefix when first reused here, and on eviction
    "evict": frozenset({"evict"}),
    "off": frozenset(),
}
MAX_QUEUE_BYTES = 256 << 20


class RecentSet:
    """Hashes pushed or pulled lately, so the same block is not written again (bounded, LRU)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._items: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, h: BlockHash) -> None:
        with self._lock:
            self._items[h] = None
            self._items.move_to_end(h)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def __contains__(self, h: BlockHash) -> bool:
        with self._lock:
            return h in self._items


class KVSaveQueue:
    """Blocks copied out of the KV tensor, waiting for the store client. `save` runs on the engine
    thread; `take_batch`, `done` and `pending` on the client's; one lock between them."""

    def __init__(self, kv_io: KVBlockIO, counters: CounterBoard, max_bytes: int = MAX_QUEUE_BYTES) -> None:
        self.kv_io = kv_io
        self.counters = counters
        self.block_bytes = kv_io.format.block_bytes
        self.recent = RecentSet()  # also fed by pulls: never push back what was just pulled
        self._queue: collections.deque[tuple[BlockHash, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._in_flight = 0  # blocks of the batch being written now
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def save(self, blocks: Sequence[Save]) -> None:
        """Copy blocks out (the runner calls this around its forward)."""
        # A cache write must never fail the step.
        try:
            self._enqueue(list(blocks))
        except Exception:
            log.exception("could not copy KV blocks out for the shared store; dropped them")
            self.counters.inc("kv_store_push_dropped_blocks", len(blocks))

    def _enqueue(self, blocks: list[Save]) -> None:
        todo = [(i, h) for i, h in blocks if h not in self.recent]
        if not todo:
            return
        with self._lock:
            room = max(0, (self._max_bytes - self._queued_bytes) // self.block_bytes)
        if len(todo) > room:
            self.counters.inc("kv_store_push_dropped_blocks", len(todo) - room)
            todo = todo[:room]
        payloads = self.kv_io.export([i for i, _ in todo])
        with self._lock:
            for (_, h), payload in zip(todo, payloads, strict=True):
                self._queue.append((h, payload))
                self.recent.add(h)
            self._queued_bytes += self.block_bytes * len(todo)

    def queued(self) -> list[tuple[BlockHash, bytes]]:
        """What waits now, oldest first (a copy)."""
        with self._lock:
            return list(self._queue)

    def take_batch(self, max_bytes: int) -> list[tuple[BlockHash, bytes]]:
        """The oldest blocks, up to `max_bytes`; `pending` counts them until `done()`."""
        batch: list[tuple[BlockHash, bytes]] = []
        with self._lock:
            while self._queue and len(batch) * self.block_bytes < max_bytes:
                batch.append(self._queue.popleft())
            self._queued_bytes -= len(batch) * self.block_bytes
            self._in_flight = len(batch)  # under the lock: `pending` never misses a batch in hand
        return batch

    def done(self) -> None:
        """The batch in hand was written or dropped."""
        with self._lock:
            self._in_flight = 0

    @property
    def pending(self) -> int:
        """Blocks queued or being written: 0 once every block offered so far was written or dropped."""
        with self._lock:
            return len(self._queue) + self._in_flight
