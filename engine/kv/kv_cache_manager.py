"""KVCacheManager: each request's block table, prefix-cache lookups, allocation, copy-on-write,
and imports of KV blocks computed elsewhere (the shared block store, P/D transfers)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvharbor.common.block_hash import BlockHash
from kvharbor.engine.kv.block_pool import Block, BlockPool
from kvharbor.engine.request import Request


class PrefixHit(NamedTuple):
    blocks: list[Block]
    num_tokens: int


class Load(NamedTuple):
    """One imported block: the runner writes `payload` into block `block_id` before the forward."""

    block_id: int
    payload: bytes


class KVCacheManager:
    """Maps request ids to block tables over one BlockPool.

    Tables are append-only while a request runs; `free` releases a whole table tail first, so a
    request's last blocks are evicted before its prefix (which other requests are likelier to share).

    With `window` (every layer slides within it: ModelArch.kv_window), a block whose tokens all lie
    before the window of the next token to compute is never read again: allocation releases it
    to the pool (cached blocks stay cached, so a later prefix hit still finds them) and puts the
    null block in its table slot. The null block is held for the manager's life and never
    written (no token's slot is in it), so it stays the zeros the cache starts as: the torch
    path gathers it and masks it out; the CPU kernel reads at most the 15 positions before the
    window that share its first 16-position block (weight 0: finite rows, or the null block's
    zeros, so nothing can turn into NaN). A sequence
    then holds about window / block_size + 1 blocks however long it grows.
    """

    def __init__(self, pool: BlockPool, window: int | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.window = window
        self.null_block = pool.get_new_blocks(1)[0] if window else None
        self.window_released = 0  # blocks released because the window passed them (a counter)
        self._passed: dict[str, int] = {}  # table entries already replaced by the null block
        self.tables: dict[str, list[Block]] = {}
        self._num_hashed: dict[str, int] = {}  # table entries already offered to the hash map
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
        self._loads: list[Load] = []  # imported, not yet written: for the next plan
        self._importing: list[Block] = []  # imported blocks whose KV the runner has not written
        self._held: list[Block] = []  # those and their chains' blocks, in release order
        self._pins: dict[str, list[Block]] = {}  # P/D hand-offs: cached blocks kept for a decode engine

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """The pool's blocks less the null block: what requests can hold (the /load total)."""
        return self.pool.num_blocks - (self.null_block is not None)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of `request`, capped so its last token is always computed
        (the model must run on it to produce logits). Mutates nothing."""
        if not self.pool.enable_caching or request.params.pooling == "mean":  # it needs every token's hidden state
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
        revived = sum(1 for b in hit_blocks[self._passed_in_hit(request, hit) :] if b.ref_cnt == 0)
        return needed + revived + int(self._needs_copy(request, table))

    def _passed_in_hit(self, request: Request, hit: PrefixHit | None) -> int:
        """How many of a prefix hit's blocks lie wholly before the window of its first new token:
        they are not adopted (nor revived from the free list); the null block takes their slots.
        Without this a hit could need more blocks than a windowed request ever holds, and a
        request the pool was sized for would wait forever."""
        if self.window is None or not hit or not hit.blocks:
            return 0
        first_needed = request.num_computed_tokens + hit.num_tokens - self.window + 1
        return min(max(0, first_needed) // self.block_size, len(hit.blocks))

    def _needs_copy(self, request: Request, table: list[Block]) -> bool:
        # Writing into a partially filled last block that a sibling sample also uses.
        return bool(table) and request.num_computed_tokens % self.block_size != 0 and table[-1].ref_cnt > 1

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[tuple[int, int]] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones (and after
        the prefix `hit`, which it adopts). Registers the full blocks these tokens complete.

        Returns the (src, dst) block copies the runner must do first (copy-on-write), or None
        when the pool is too short; then nothing was changed (but blocks the sliding window has
        passed, released first) and the caller may preempt.
        Passing `hit` (admission from the queue) counts the lookup in the hit-rate counters.
        """
        hit_blocks = hit.blocks if hit else []
        table = self.tables.get(request.request_id, [])
        self._release_passed(request, table)
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_free:
            return None
        table = self.tables.setdefault(request.request_id, table)
        if hit is not None:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit.num_tokens
        if hit_blocks:
            passed = self._passed_in_hit(request, hit)
            kept = hit_blocks[passed:]
            self.pool.reused(kept)
            self.pool.touch(kept)
            table.extend([self.null_block] * passed + kept)
            self._num_hashed[request.request_id] = len(table)
            if passed:
                self._passed[request.request_id] = len(table) - len(kept)
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

    def _release_passed(self, request: Request, table: list[Block]) -> None:
        """Release the blocks wholly before the window of the next token to compute (position
        p = num_computed_tokens sees keys from p - window + 1), leaving the null block in their
        slots."""
        if self.window is None or not table:
            return
        first_needed = request.num_computed_tokens - self.window + 1
        upto = min(max(0, first_needed) // self.block_size, len(table))
        done = self._passed.get(request.request_id, 0)
        if upto <= done:
            return
        passed = [b for b in table[done:upto] if b is not self.null_block]
        table[done:upto] = [self.null_block] * (upto - done)
        self._passed[request.request_id] = upto
        self.pool.free_blocks(reversed(passed))
        self.window_released += len(passed)

    def _held_blocks(self, table: Iterable[Block]) -> list[Block]:
        """A table's entries that hold a reference (all but the null block)."""
        return [b for b in table if b is not self.null_block]

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
        self.pool.touch(self._held_blocks(table))
        self.tables[child.request_id] = list(table)
        self._num_hashed[child.request_id] = self._num_hashed.get(parent.request_id, 0)
        self._passed[child.request_id] = self._passed.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's whole table, tail first. Safe to call twice."""
        table = self.tables.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        self._passed.pop(request.request_id, None)
        if table:
            self.pool.free_blocks(reversed(self._held_blocks(table)))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks holding the first `num_tokens` tokens (after speculation: rejected
        tokens' slots go back, tail first). Blocks past them were never hashed: only blocks of
        the request's own tokens are, and those are all kept."""
        table = self.tables.get(request.request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        assert self._num_hashed.get(request.request_id, 0) <= keep, "a hashed block would be dropped"
        assert self._passed.get(request.request_id, 0) <= keep, "a block the window passed would be dropped"
        if len(table) > keep:
            self.pool.free_blocks(reversed(table[keep:]))
            del table[keep:]

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.tables.get(request.request_id, [])]

    def uncache_blocks(self, requests: Iterable[Request], start: int = 0) -> None:
        """Forget cached hashes of these requests' blocks from token `start` on (a failed step
        wrote garbage there; the blocks before it, a prefix other requests may share, stay).

        Only for requests about to be finished: their tables' hash bookkeeping is reset.
        """
        first = start // self.block_size  # a block that held tokens before `start` was not full: not cached
        for request in requests:
            self.pool.uncache(self._held_blocks(self.tables.get(request.request_id, [])[first:]))
            self._num_hashed[request.request_id] = min(self._num_hashed.get(request.request_id, 0), first)

    # -- imports ----------------------------------------------------------------------------------

    def cached_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes` (a chain from block 0) are cached here, from the start."""
        k = 0
        while k < len(hashes) and self.pool.get_cached_block(hashes[k]) is not None:
            k += 1
        return k

    def import_blocks(
        self, hashes: Sequence[BlockHash], payloads: Sequence[bytes], prefix: Sequence[BlockHash], block_bytes: int
    ) -> int:
        """Cache blocks whose KV was computed elsewhere, as if computed here.

        `hashes` continues the chain `prefix` (cached here; empty when the chain starts at block
        0); `payloads[i]` is block i's KV, `block_bytes` long. Blocks already cached are skipped;
        the rest take free blocks (evicting the least recently used cached ones, never the
        chain's own) and are cached at once, so a request admitted in the next plan hits them.
        Their payloads go into that plan (`take_loads`): the runner writes them before the
        forward; until then they are held (`loaded` releases them). Returns the blocks imported.
        Raises ValueError (and imports nothing) for mismatched or wrong-sized payloads.
        """
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
        bad = next((len(p) for p in payloads if len(p) != block_bytes), None)
        if bad is not None:
            raise ValueError(f"a KV block payload is {bad} bytes, expected {block_bytes}")
        pool = self.pool
        if not pool.enable_caching:
            return 0
        # Out of the free list while we allocate: no block of the chain may be the one evicted.
        pinned = [pool.cached[h] for h in (*prefix, *hashes) if h in pool.cached]
        pool.touch(pinned)
        todo = [(h, p) for h, p in zip(hashes, payloads, strict=True) if h not in pool.cached]
        todo = todo[: pool.num_free]
        blocks = pool.get_new_blocks(len(todo)) if todo else []
        chain = [*prefix, *hashes]
        position = {h: i for i, h in enumerate(chain)}
        for block, (h, payload) in zip(blocks, todo, strict=True):
            i = position[h]
            pool.cache_blocks([block], [h], chain[i - 1] if i else None)
            self._loads.append(Load(block.block_id, payload))
        self._importing += blocks
        # Released tail first, the chain's cached blocks last: the chain is evicted from its end.
        self._held += [*reversed(blocks), *reversed(pinned)]
        return len(todo)

    # -- pins (P/D hand-offs) ------------------------------------------------------------------------

    def pin(self, key: str, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the cached run of `hashes` (a chain from block 0) under `key`, so no eviction can
        reuse those blocks until `unpin(key)`. Returns their block ids, in chain order."""
        if key in self._pins:
            raise ValueError(f"KV blocks are already pinned under {key!r}")
        blocks = [self.pool.cached[h] for h in hashes[: self.cached_run(hashes)]]
        self.pool.touch(blocks)
        self._pins[key] = blocks
        return [b.block_id for b in blocks]

    def unpin(self, key: str) -> bool:
        """Release what `pin(key)` held (tail first, so the chain is evicted from its end)."""
        blocks = self._pins.pop(key, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    @property
    def has_loads(self) -> bool:
        """Imported blocks wait for their write (a step must run, even with no request)."""
        return bool(self._loads)

    def take_loads(self) -> list[Load]:
        """The imported blocks the next plan's runner must write (handed over once)."""
        loads, self._loads = self._loads, []
        return loads

    def loaded(self, ok: bool = True) -> None:
        """The runner wrote the loads it took (or failed to: `ok=False` forgets their hashes, as
        their KV cannot be trusted). The imported blocks and their chains are released."""
        if not ok:
            self.pool.uncache(self._importing)
        held, self._held, self._importing = self._held, [], []
        self.pool.free_blocks(held)

    def check_integrity(self) -> None:
        """The pool's own checks, plus: every refcount equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = Counter(b.block_id for table in self.tables.values() for b in self._held_blocks(table))
        if self.null_block is not None:  # the manager's own reference
            holders[self.null_block.block_id] += 1
            assert self.null_block.block_hash is None, "the null block was cached: it would be written"
        holders.update(b.block_id for b in self._held)  # imports awaiting their write hold a reference
        holders.update(b.block_id for blocks in self._pins.values() for b in blocks)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block} is held by {holders.get(block.block_id, 0)} tables"
            )
