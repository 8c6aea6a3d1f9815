"""KVCacheManager: each request's block table, prefix-cache lookups, allocation and copy-on-write."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from kvharbor.engine.block_pool import Block, BlockPool
from kvharbor.engine.request import Request


class PrefixHit(NamedTuple):
    blocks: list[Block]
    num_tokens: int


class KVCacheManager:
    """Maps request ids to block tables over one BlockPool.

    Tables are append-only while a request runs; `free` releases a whole table tail first, so a
    request's last blocks are evicted before its prefix (which other requests are likelier to share).
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.tables: dict[str, list[Block]] = {}
        self._num_hashed: dict[str, int] = {}  # table entries already offered to the hash map
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of `request`, capped so its last token is always computed
        (the model must run on it to produce logits). Mutates nothing."""
        if not self.pool.enable_caching:
            return PrefixHit([], 0)
        hashes = request.full_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks `allocate_slots` would take for these tokens after `hit`: new blocks,
        copy-on-write copies, and cached free blocks the hit revives from the free list."""
        table = self.tables.get(request.request_id, [])
        hit_blocks = hit.blocks if hit else []
        total = request.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(table) - len(hit_blocks))
        revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return needed + revived + int(self._needs_copy(request, table))

    def _needs_copy(self, request: Request, table: list[Block]) -> bool:
        # Writing into a partially filled last block that a sibling sample also uses.
        return bool(table) and request.num_computed_tokens % self.block_size != 0 and table[-1].ref_cnt > 1

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[tuple[int, int]] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones (and after
        the prefix `hit`, which it adopts). Registers the full blocks these tokens complete.

        Returns the (src, dst) block copies the runner must do first (copy-on-write), or None
        when the pool is too short; then nothing was changed and the caller may preempt.
        Passing `hit` (admission from the queue) counts the lookup in the hit-rate counters.
        """
        hit_blocks = hit.blocks if hit else []
        table = self.tables.get(request.request_id, [])
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_free:
            return None
        table = self.tables.setdefault(request.request_id, table)
        if hit is not None:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit.num_tokens
        if hit_blocks:
            if self.pool.on_reuse is not None:
                self.pool.on_reuse(hit_blocks)
            self.pool.touch(hit_blocks)
            table.extend(hit_blocks)
            self._num_hashed[request.request_id] = len(table)
        copies = []
        if self._needs_copy(request, table):
            shared = table[-1]
            (fresh,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([shared])
            table[-1] = fresh
            copies.append((shared.block_id, fresh.block_id))
        total = request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        missing = -(-total // self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.get_new_blocks(missing))
        self._cache_full_blocks(request, table, total)
        return copies

    def _cache_full_blocks(self, request: Request, table: list[Block], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        done = self._num_hashed.get(request.request_id, 0)
        hashes = request.full_block_hashes(self.block_size)
        upto = min(num_tokens // self.block_size, len(hashes))
        if upto <= done:
            return
        parent = hashes[done - 1] if done > 0 else None
        self.pool.cache_blocks(table[done:upto], hashes[done:upto], parent)
        self._num_hashed[request.request_id] = upto

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share every block of `parent` (one more reference each)."""
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's whole table, tail first. Safe to call twice."""
        table = self.tables.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` tokens (after speculation: rejected
        tokens' slots go back, tail first). Blocks past them were never hashed: only blocks of
        the request's own tokens are, and those are all kept."""
        table = self.tables.get(request.request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        assert self._num_hashed.get(request.request_id, 0) <= keep, "a hashed block would be dropped"
        if len(table) > keep:
            self.pool.free_blocks(reversed(table[keep:]))
            del table[keep:]

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.tables.get(request.request_id, [])]

    def uncache_blocks(self, requests: Iterable[Request]) -> None:
        """Forget cached hashes of these requests' blocks (after a failed step wrote garbage).

        Only for requests about to be finished: their tables' hash bookkeeping is reset.
        """
        for request in requests:
            self.pool.uncache(self.tables.get(request.request_id, []))
            self._num_hashed[request.request_id] = 0

    @property
    def usage(self) -> float:
        """Share of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def check_integrity(self) -> None:
        """The pool's own checks, plus: every refcount equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = Counter(b.block_id for table in self.tables.values() for b in table)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block} is held by {holders.get(block.block_id, 0)} tables"
            )
