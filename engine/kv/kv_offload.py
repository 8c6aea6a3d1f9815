"""KVStoreClient: the engine's side of the shared block store (kvharbor.kvcache_service.block_store).

Pull: for a request with `kv_prefix_source=shared`, the core process asks `pull()` for the longest
run of the prompt's blocks that this engine lacks and the store holds; the engine thread imports
them into the prefix cache just before it admits the request (core_io.EngineRequest.external_prefix,
KVCacheManager.import_blocks; the next plan's runner writes their KV), so their prefill is
skipped. A refused or missing block ends the run; the rest is computed as usual.

Push: the engine thread copies blocks out into the core's KVSaveQueue (engine/kv/kv_save.py, by
the push policy the core was built with); `run()`, an asyncio task, takes them off in batches
and writes them to Redis. Nothing here touches the pool from another thread: `pull` asks the
engine thread what is cached (`ask`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvharbor.common.block_hash import BlockHash, block_hashes
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.kv.kv_save import KVSaveQueue
from kvharbor.kvcache_service.block_store import BlockStoreUnavailable, RedisBlockStore
from kvharbor.kvcache_service.reuse_stats import classify, record

log = logging.getLogger("kvharbor.engine.kv_store")
PUSH_BATCH_BYTES = 16 << 20
PULL_SLICE_BLOCKS = 32
T = TypeVar("T")
Ask = Callable[[Callable[[Any], T]], Awaitable[T]]  # run fn(core) in the engine thread


@dataclass(frozen=True)
class ExternalPrefix:
    """Blocks pulled for one request: `hashes` continue the chain `prefix` (cached here)."""

    prefix: list[BlockHash]
    hashes: list[BlockHash]
    payloads: list[bytes]


class KVStoreClient:
    def __init__(
        self, store: RedisBlockStore, engine: Any, ask: Ask | None = None, max_pull_bytes: int = 256 << 20
    ) -> None:
        """`engine`: the EngineCore (its `kv_saves` queue is what `run` writes: None when it was
        built to push nothing); `ask` runs a function on it in its thread (EngineLoop.call).
        Without `ask`, the caller is the engine's thread (tests, offline use)."""
        self.store = store
        self.engine = engine
        self.saves: KVSaveQueue | None = engine.kv_saves
        self._ask: Ask = ask or self._ask_here
        self.counters: CounterBoard = engine.board
        self.format = engine.kv_io.format
        self.max_pull_bytes = max_pull_bytes
        self._refused_seen: dict[str, int] = {}
        self._stopping = asyncio.Event()

    async def _ask_here(self, fn: Callable[[Any], T]) -> T:
        return fn(self.engine)

    # -- the event loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Write queued blocks until `stop()`; Redis trouble drops the batch and backs off."""
        if self.saves is None:  # an engine that pushes nothing
            await self._stopping.wait()
            return
        backoff = 0.5
        while not self._stopping.is_set():
            batch = self.saves.take_batch(PUSH_BATCH_BYTES)
            if not batch:
                await self._sleep(0.02)
                continue
            try:
                await self._write(batch)
                backoff = 0.5
            except BlockStoreUnavailable as exc:
                self.counters.inc("kv_store_errors", label="push")
                self.counters.inc("kv_store_push_dropped_blocks", len(batch))
                log.warning("shared block store unavailable; dropped %d blocks", len(batch), extra={"error": str(exc)})
                await self._sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                self.saves.done()

    async def _write(self, batch: list[tuple[BlockHash, bytes]]) -> None:
        await self.store.put(self.format, batch)
        size = len(batch) * self.format.block_bytes
        self.counters.inc("kv_store_pushed_blocks", len(batch))
        self.counters.inc("kv_store_pushed_bytes", size)
        with contextlib.suppress(Exception):
            await record(self.store.client, self.engine.model_name, {"blocks_pushed": len(batch), "bytes_pushed": size})

    @property
    def pending(self) -> int:
        """Blocks queued or being written: 0 once every block offered so far was written or dropped."""
        return self.saves.pending if self.saves is not None else 0

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
        if self.saves is not None:
            for h in hashes[k : k + len(payloads)]:
                self.saves.recent.add(h)  # never push back what was just pulled
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
