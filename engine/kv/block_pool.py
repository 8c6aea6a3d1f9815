"""The KV block pool: reference counts, the prefix-cache hash map and an O(1) LRU free list.

Pure Python, no torch. A block's id is its index in every layer's KV tensor.

Lifecycle of a block:
    free (ref 0, maybe cached) --get_new_blocks/touch--> in use (ref >= 1) --free_blocks--> free
A free block keeps its hash, so a later request can revive it (`touch`) until the free list
hands it out again; only then does it leave the hash map and a `BlockRemoved` event is queued.

Copy-outs (for the shared block store, engine/kv/kv_offload.py) are recorded, never carried out
here: which cached blocks are about to be overwritten (`evict`), reused (`reuse`) or were just
filled (`fill`), as the scheduler's plan will need them. `take_saves` hands them over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent

SaveOn = Literal["evict", "reuse", "fill"]
Save = tuple[int, BlockHash]  # (block id, its hash): one block to copy out


class Block:
    """One physical KV block. `prev_free`/`next_free` link it into the free list (intrusive)."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: pop from the head (least recently freed),
    append at the tail, and remove from the middle in O(1) when a cache hit revives a block."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free list")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one engine, and the map from block hash to the block that holds it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        max_queued_events: int = 100_000,
        save_on: frozenset[SaveOn] = frozenset(),
    ) -> None:
        """`save_on`: when blocks are recorded for copy-out to the shared store (kv_save.SAVE_ON;
        empty: never, and it costs nothing)."""
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.enable_events = enable_events
        # NOTE: bounded, so a stalled consumer costs events, not memory; it learns of the loss
        # through `events_dropped` and must re-sync from `cached_hashes()`.
        self._events: deque[KVEvent] = deque(maxlen=max_queued_events)
        self.events_dropped = 0
        self.save_on = save_on
        self._save_before: list[Save] = []  # intact now; the next forward may overwrite them
        self._save_after: list[Save] = []  # the next forward fills them

    @property
    def num_free(self) -> int:
        """Blocks with no user, cached or not: what `get_new_blocks` can hand out."""
        return self.free_queue.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop `n` blocks from the head of the free list, each with ref 1 and no hash.

        Raises ValueError if fewer than `n` are free; callers check `num_free` first.
        """
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks but only {self.num_free} are free")
        out = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if "evict" in self.save_on:
                    self._save_before.append((block.block_id, block.block_hash))
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._emit(BlockRemoved(hashes=tuple(evicted)))
        return out

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def reused(self, blocks: Sequence[Block]) -> None:
        """A prefix-cache hit adopts `blocks` (its KV is intact: record them when saving on reuse)."""
        if "reuse" in self.save_on:
            self._save_before.extend((b.block_id, b.block_hash) for b in blocks if b.block_hash is not None)

    def take_saves(self) -> tuple[list[Save], list[Save]]:
        """Hand over the blocks recorded for copy-out: (before the next forward, after it)."""
        saves = self._save_before, self._save_after
        self._save_before, self._save_after = [], []
        return saves

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block, reviving free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference per block, in the given order; blocks reaching 0 join the tail of
        the free list in that order (so the first given is evicted first)."""
        for block in blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(self, blocks: Sequence[Block], hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """Register full `blocks` under `hashes` (same length, a chain after `parent`).

        NOTE: no de-duplication. If a hash is already mapped to another block, this block stays
        unhashed and the map keeps the first one, so block tables remain append-only. Each
        unbroken run of newly stored hashes is announced as one `BlockStored` chain.
        """
        if not self.enable_caching or not blocks:
            return
        run: list[BlockHash] = []
        run_parent = parent
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block.block_hash is not None:
                raise ValueError(f"{block} is already cached")
            if block_hash in self.cached:
                self._emit_stored(run, run_parent)
                run, run_parent = [], block_hash
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            run.append(block_hash)
            if "fill" in self.save_on:
                self._save_after.append((block.block_id, block_hash))
        self._emit_stored(run, run_parent)

    def _emit_stored(self, run: list[BlockHash], parent: BlockHash | None) -> None:
        if run:
            self._emit(BlockStored(hashes=tuple(run), parent=parent, block_size=self.block_size))

    def uncache(self, blocks: Iterable[Block]) -> None:
        """Forget the hashes of `blocks` (their KV can no longer be trusted)."""
        removed = []
        for block in blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                removed.append(block.block_hash)
            block.block_hash = None
        if removed:
            self._emit(BlockRemoved(hashes=tuple(removed)))

    def reset_prefix_cache(self) -> None:
        """Drop every hash (blocks in use keep their KV, but nobody can hit them anymore)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._emit(AllCleared())

    def _emit(self, event: KVEvent) -> None:
        if not self.enable_events:
            return
        if len(self._events) == self._events.maxlen:
            self.events_dropped += 1
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """Hand over and forget the queued KV events, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash reusable right now (for a full re-sync of the KV index)."""
        return list(self.cached)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + in use == total and the free list and hash map agree."""
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free-list length differs from its counter"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free list"
        assert all(b.ref_cnt == 0 for b in free), "a block in the free list has users"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + len(free) == self.num_blocks, f"{in_use} in use + {len(free)} free != {self.num_blocks}"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map points at {block} under another hash"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self.cached), "a block carries a hash that is not in the map"
