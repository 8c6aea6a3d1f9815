"""P/D hand-offs, the prefill engine's side: the KV a finished prefill keeps for a decode engine.

A request added with `hand_off=True` is a prefill for another engine: it runs its prompt and
samples the first token like any request. When it finishes, the core pins the prompt's full
blocks under a lease named by the request id (KVCacheManager.pin), so no eviction can reuse them
while the decode engine pulls them (engine/kv/kv_handoff_link.py). The lease ends when the decode
side confirms (`release`) or when it expires; either way the blocks go back to the pool as
ordinary cached blocks, still good for prefix hits here.

The handle a decode engine presents names the lease signed (engine/kv/handoff_handles.py).

Everything here runs in the engine thread (the pool is only consistent there), except `export`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvharbor.common.block_hash import BlockHash
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv.kv_transfer import KVBlockIO


@dataclass
class Lease:
    hashes: list[BlockHash]  # the pinned chain, from block 0
    block_ids: list[int]
    expires: float


class HandoffLeases:
    def __init__(self, kv: KVCacheManager, kv_io: KVBlockIO, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the hand-off lease must be > 0 seconds, got {ttl_s}")
        self.kv = kv
        self.kv_io = kv_io
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}
        self.expired = 0  # leases that ended without a confirmation
        self.confirmed = 0

    def hold(self, handle: str, hashes: Sequence[BlockHash], now: float | None = None) -> int:
        """Pin the cached run of `hashes` for a decode engine; returns how many blocks it holds."""
        ids = self.kv.pin(handle, hashes)
        now = time.monotonic() if now is None else now
        self._leases[handle] = Lease(list(hashes[: len(ids)]), ids, now + self.ttl_s)
        return len(ids)

    def export(self, handle: str, start: int, count: int) -> tuple[list[BlockHash], list[bytes]] | None:
        """Blocks [start, start + count) of a lease as (hashes, payloads); None if it is gone.

        Safe from another thread than the engine's (the hand-off server copies there, so a
        transfer never waits for a step to end): pinned blocks are full and cached, and nothing
        writes a block with a reference but its owner while filling it. Only the lease's end can
        free them mid-copy, so the copy counts only if the same lease is still held after it."""
        lease = self._leases.get(handle)
        if lease is None:
            return None
        end = min(len(lease.block_ids), start + count)
        payloads = self.kv_io.export(lease.block_ids[start:end])
        if self._leases.get(handle) is not lease:
            return None  # released or expired while copying: the bytes may be another request's
        return lease.hashes[start:end], payloads

    def size(self, handle: str) -> int | None:
        lease = self._leases.get(handle)
        return None if lease is None else len(lease.block_ids)

    def release(self, handle: str) -> bool:
        """The decode side has the blocks: unpin them. False if the lease was already gone."""
        if self._leases.pop(handle, None) is None:
            return False
        self.kv.unpin(handle)
        self.confirmed += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """End every lease past its time (a decode engine that died or gave up); returns how many."""
        now = time.monotonic() if now is None else now
        gone = [h for h, lease in self._leases.items() if lease.expires <= now]
        for handle in gone:
            del self._leases[handle]
            self.kv.unpin(handle)
        self.expired += len(gone)
        return len(gone)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())
