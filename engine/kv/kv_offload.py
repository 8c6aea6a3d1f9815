"""KVStoreClient: the engine's side of the shared block store (kvharbor.kvcache_service.block_store).

Pull: for a request with `kv_prefix_source=shared`, the core process asks `pull()` for the longest
run of the prompt's blocks that this engine lacks and the store holds; the engine thread imports
them into the prefix cache just before it admits the request (core_io.EngineRequest.external_prefix,
KVCacheManager.import_blocks; the next plan's runner writes their KV), so their prefill is
skipped. A refused or missing block ends the run; the rest is computed as usual.

Push, by policy:
- `all`: every block this engine fills is copied out after the step that filled it (write-through).
- `hot` (default): a prefix is copied out the first time it is reused here (a system prompt, a
  shared document: what other engines are likely to want), and blocks on eviction, as `evict`.
- `evict`: a cached block is copied out just before its slot is reused (write-back on eviction).
- `off`: never.
The block pool records which blocks to copy out (BlockPool.save_on); they travel in the
scheduler's plan and the runner hands them to `save` before or after its forward, in the engine
thread (the KV tensor is only consistent there). An asyncio task writes them to Redis. The queue
is bounded in bytes: beyond it, blocks are dropped and counted. Nothing here touches the pool
from another thread: `pull` asks the engine thread what is cached (`ask`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from kvharbor.common.block_hash import BlockHash, block_hashes
from kvharbor.engine.core_io import Counters
from kvharbor.kvcache_service.block_store import BlockStoreUnavailable, RedisBlockStore
from kvharbor.kvcache_service.reuse_stats import classify, record

log = logging.getLogger("kvharbor.engine.kv_store")
PushPolicy = Literal["all", "hot", "evict", "off"]
PUSH_BATCH_BYTES = 16 << 20
PULL_SLICE_BLOCKS = 32
SAVE_ON: dict[str, frozenset[str]] = {
    "all": frozenset({"fill"}),  # write-through: every block the forward fills
    "hot": frozenset({"reuse", "evict"}),  # a prefix when first reused here, and on eviction
    "evict": frozenset({"evict"}),
    "off": frozenset(),
}
T = TypeVar("T")
Ask = Callable[[Callable[[Any], T]], Awaitable[T]]  # run fn(core) in the engine thread


@dataclass(frozen=True)
class ExternalPrefix:
    """Blocks pulled for one request: `hashes` continue the chain `prefix` (cached here)."""

    prefix: list[BlockHash]
    hashes: list[BlockHash]
    payloads: list[bytes]


class _RecentSet:
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


class KVStoreClient:
    def __init__(
        self,
        store: RedisBlockStore,
        engine: Any,
        policy: PushPolicy,
        counters: Counters,
        max_queue_bytes: int = 256 << 20,
        max_pull_bytes: int = 256 << 20,
        ask: Ask | None = None,
    ) -> None:
        """`engine`: the EngineCore; `ask` runs a function on it in its thread (EngineLoop.call).
        Without `ask`, the caller is the engine's thread (tests, offline use)."""
        self.store = store
        self.engine = engine
        self._ask: Ask = ask or self._ask_here
        self.policy = policy
        self.counters = counters
        self.format = engine.kv_io.format
        self._queue: collections.deque[tuple[BlockHash, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._in_flight = 0  # blocks of the batch being written now
        self._max_queue_bytes = max_queue_bytes
        self.max_pull_bytes = max_pull_bytes
        self._lock = threading.Lock()
        self._recent = _RecentSet()
        self._refused_seen: dict[str, int] = {}
        self._stopping = asyncio.Event()

    async def _ask_here(self, fn: Callable[[Any], T]) -> T:
        return fn(self.engine)

    def install(self) -> None:
        """Tell the pool what to record and the runner where to send it (before the loop starts)."""
        self.engine.pool.save_on = SAVE_ON[self.policy]
        self.engine.runner.save = self.save

    # -- the engine thread ------------------------------------------------------------------------

    def save(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Copy blocks out (the runner calls this around its forward)."""
        # A cache write must never fail the step.
        try:
            self._enqueue(list(blocks))
        except Exception:
            log.exception("could not copy KV blocks out for the shared store; dropped them")
            self.counters.inc("kv_store_push_dropped_blocks", len(blocks))

    def _enqueue(self, blocks: list[tuple[int, BlockHash]]) -> None:
        todo = [(i, h) for i, h in blocks if h not in self._recent]
        if not todo:
            return
        size = self.format.block_bytes
        with self._lock:
            room = max(0, (self._max_queue_bytes - self._queued_bytes) // size)
        if len(todo) > room:
            self.counters.inc("kv_store_push_dropped_blocks", len(todo) - room)
            todo = todo[:room]
        payloads = self.engine.kv_io.export([i for i, _ in todo])
        with self._lock:
            for (_, h), payload in zip(todo, payloads, strict=True):
                self._queue.append((h, payload))
                self._recent.add(h)
            self._queued_bytes += size * len(todo)

    # -- the event loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Write queued blocks until `stop()`; Redis trouble drops the batch and backs off."""
        backoff = 0.5
        while not self._stopping.is_set():
            batch = self._take_batch()
            if not batch:
                await self._sleep(0.02)
                continue
            try:
                await self.store.put(self.format, batch)
                backoff = 0.5
                self.counters.inc("kv_store_pushed_blocks", len(batch))
                self.counters.inc("kv_store_pushed_bytes", len(batch) * self.format.block_bytes)
                pushed = {"blocks_pushed": len(batch), "bytes_pushed": len(batch) * self.format.block_bytes}
                with contextlib.suppress(Exception):
                    await record(self.store.client, self.engine.model_name, pushed)
            except BlockStoreUnavailable as exc:
                self.counters.inc("kv_store_errors", label="push")
                self.counters.inc("kv_store_push_dropped_blocks", len(batch))
                log.warning("shared block store unavailable; dropped %d blocks", len(batch), extra={"error": str(exc)})
                await self._sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                self._in_flight = 0

    @property
    def pending(self) -> int:
        """Blocks queued or being written: 0 once every block offered so far was written or dropped."""
        with self._lock:
            return len(self._queue) + self._in_flight

    def _take_batch(self) -> list[tuple[BlockHash, bytes]]:
        batch: list[tuple[BlockHash, bytes]] = []
        with self._lock:
            while self._queue and len(batch) * self.format.block_bytes < PUSH_BATCH_BYTES:
                batch.append(self._queue.popleft())
            self._queued_bytes -= len(batch) * self.format.block_bytes
            self._in_flight = len(batch)  # under the lock: `pending` never misses a batch in hand
        return batch

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def stop(self) -> None:
        """Stop writing (queued blocks are dropped: the store is a cache) and close the client."""
        self._stopping.set()
        await asyncio.sleep(0)
        await self.store.close()

    async def pull(
        self, prompt_ids: list[int], cache_salt: str | None, adapter: str | None = None
    ) -> ExternalPrefix | None:
        """The longest run of the prompt's blocks, after those cached here, that the store holds.

        Only blocks before the prompt's last token count (that token is always computed). Never
        raises for store trouble: the request then computes its prefill as usual.
        """
        engine = self.engine
        if not 1 < len(prompt_ids) <= engine.max_model_len:
            return None  # the engine refuses it anyway; do not move bytes for it
        bs = engine.capacity.block_size
        try:
            hashes = block_hashes(prompt_ids[:-1], bs, engine.model_name, cache_salt, adapter)
        except ValueError:
            return None  # token ids out of range: the engine answers 400 with its own message
        k, free = await self._ask(lambda core: (core.kv.cached_run(hashes), core.pool.num_free))
        # Never more than the pool could take, nor more bytes than one pull may move.
        limit = min(len(hashes) - k, free, max(1, self.max_pull_bytes // self.format.block_bytes))
        if limit <= 0:
            return None
        try:
            payloads = await self._get_run(hashes[k : k + limit])
        except BlockStoreUnavailable as exc:
            self.counters.inc("kv_store_errors", label="pull")
            log.warning("shared block store unavailable; computing the prefill", extra={"error": str(exc)})
            return None
        finally:
            self._count_refusals()
        if not payloads:
            return None
        for h in hashes[k : k + len(payloads)]:
            self._recent.add(h)  # never push back what was just pulled
        return ExternalPrefix(hashes[:k], hashes[k : k + len(payloads)], payloads)

    async def _get_run(self, hashes: list[BlockHash]) -> list[bytes]:
        # In slices, so one pull never blocks Redis (and its index lookups) for long.
        out: list[bytes] = []
        for i in range(0, len(hashes), PULL_SLICE_BLOCKS):
            part = hashes[i : i + PULL_SLICE_BLOCKS]
            got = await self.store.get_run(self.format, part)
            out += got
            if len(got) < len(part):
                break
        return out

    def _count_refusals(self) -> None:
        for reason, n in self.store.refused.items():
            new = n - self._refused_seen.get(reason, 0)
            if new:
                self.counters.inc("kv_store_refused_blocks", new, label=reason)
                self._refused_seen[reason] = n

    def pulled(self, blocks: int) -> None:
        self.counters.inc("kv_store_pulled_blocks", blocks)
        self.counters.inc("kv_store_pulled_bytes", blocks * self.format.block_bytes)

    async def record_reuse(self, prompt_tokens: int, cached_tokens: int, pulled_blocks: int) -> None:
        """Add one finished request to the model's reuse counters in Redis (best effort)."""
        bs = self.engine.capacity.block_size
        increments = classify(prompt_tokens // bs, cached_tokens // bs, pulled_blocks)
        if pulled_blocks:
            increments["bytes_pulled"] = pulled_blocks * self.format.block_bytes
        with contextlib.suppress(Exception):
            await record(self.store.client, self.engine.model_name, increments)
