"""Block pool and KV cache manager: exact block ids, free-list order, refcounts, copy-on-write,
eviction order, events, and integrity checks that catch corruption."""

import pytest

from kvharbor.common.block_hash import namespace_hash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored
from kvharbor.engine.kv.block_pool import BlockPool
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request
from kvharbor.engine.sampling_params import SamplingParams

BS = 4


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def make_request(rid: str, tokens: list[int], salt: str | None = None, n: int = 1) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, n=n), 8, namespace_hash("m", salt))


def test_scripted_sequence_gives_exact_ids_and_free_order():
    pool = BlockPool(6, BS)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3, 4]
    assert free_ids(pool) == [5]
    pool.free_blocks(reversed(b))  # tail first: 4, 3, 2
    assert free_ids(pool) == [5, 4, 3, 2]
    pool.free_blocks(a)
    assert free_ids(pool) == [5, 4, 3, 2, 0, 1]
    c = pool.get_new_blocks(3)
    assert [x.block_id for x in c] == [5, 4, 3]
    assert free_ids(pool) == [2, 0, 1]
    pool.check_integrity()


def test_refcounts_and_touch_revive_from_the_middle_of_the_free_list():
    pool = BlockPool(4, BS)
    blocks = pool.get_new_blocks(3)
    pool.touch([blocks[1]])
    assert [b.ref_cnt for b in blocks] == [1, 2, 1]
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 0, 2] and blocks[1].ref_cnt == 1
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [3, 0, 2, 1]
    pool.touch([blocks[0]])  # O(1) removal from the middle
    assert free_ids(pool) == [3, 2, 1] and blocks[0].ref_cnt == 1
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blocks[2]])
    pool.check_integrity()


def test_prefix_hit_capped_before_the_last_token_and_cached_blocks_stay_findable():
    kv = KVCacheManager(BlockPool(8, BS))
    tokens = list(range(12))  # exactly 3 full blocks
    first = make_request("a", tokens)
    assert kv.allocate_slots(first, 12, kv.get_computed_blocks(first)) == []
    assert kv.block_ids(first) == [0, 1, 2]
    assert kv.pool.num_cached == 3
    kv.free(first)
    assert free_ids(kv.pool) == [3, 4, 5, 6, 7, 2, 1, 0]  # freed tail first, still cached
    second = make_request("b", tokens)
    hit = kv.get_computed_blocks(second)
    # The last token must run to give logits: only 2 of the 3 cached blocks are used.
    assert hit.num_tokens == 8 and [b.block_id for b in hit.blocks] == [0, 1]
    assert kv.allocate_slots(second, 4, hit) == []
    assert kv.block_ids(second) == [0, 1, 3]  # block 2 stays free; a new block takes the tail
    kv.check_integrity()


def test_salted_requests_do_not_hit_each_other():
    kv = KVCacheManager(BlockPool(8, BS))
    a = make_request("a", list(range(9)), salt="tenant-a")
    kv.allocate_slots(a, 9)
    b = make_request("b", list(range(9)), salt="tenant-b")
    assert kv.get_computed_blocks(b).num_tokens == 0
    c = make_request("c", list(range(9)), salt="tenant-a")
    assert kv.get_computed_blocks(c).num_tokens == 8


def test_eviction_takes_least_recently_freed_and_emits_removed_events():
    pool = BlockPool(4, BS, enable_events=True)
    kv = KVCacheManager(pool)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    stored = pool.take_events()
    assert stored == [BlockStored(hashes=tuple(a.block_hashes), parent=None, block_size=BS)]
    kv.free(a)  # blocks 1, 0 join the tail after the never-used 2, 3
    b = make_request("b", [100 + t for t in range(12)])
    kv.allocate_slots(b, 12)
    assert kv.block_ids(b) == [2, 3, 1]  # block 1 (a's tail) evicted before a's prefix block 0
    events = pool.take_events()
    assert events[0] == BlockRemoved(hashes=(a.block_hashes[1],))
    assert pool.get_cached_block(a.block_hashes[0]) is not None
    assert pool.get_cached_block(a.block_hashes[1]) is None
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllCleared()] and pool.num_cached == 0
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(BlockPool(3, BS))
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = make_request("b", list(range(50, 62)))
    before = free_ids(kv.pool)
    assert kv.allocate_slots(b, 12) is None
    assert free_ids(kv.pool) == before and "b" not in kv.tables
    kv.check_integrity()


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block():
    kv = KVCacheManager(BlockPool(8, BS))
    parent = make_request("p", list(range(6)), n=2)  # one full block + a partial one
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, "p\x1f1")
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent) == [0, 1]
    assert [b.ref_cnt for b in kv.tables["p"]] == [2, 2]
    parent.append_output(7)
    child.append_output(8)
    # The parent writes token 6 into shared block 1: it gets a private copy first.
    copies = kv.allocate_slots(parent, 1)
    assert copies == [(1, 2)]
    assert kv.block_ids(parent) == [0, 2] and kv.block_ids(child) == [0, 1]
    # The child is now the only user of block 1: no copy needed.
    assert kv.allocate_slots(child, 1) == []
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 1, 1]
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    kv.check_integrity()
    assert kv.pool.num_free == 8


def test_integrity_check_catches_corruption():
    kv = KVCacheManager(BlockPool(4, BS))
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.check_integrity()
    kv.tables["a"][0].ref_cnt += 1  # a leaked reference
    with pytest.raises(AssertionError, match="held by 1 tables"):
        kv.check_integrity()
    kv.tables["a"][0].ref_cnt -= 1
    kv.pool.free_queue.num_free += 1  # a lying counter
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_events_are_off_unless_enabled_and_bounded():
    quiet = BlockPool(4, BS)
    KVCacheManager(quiet).allocate_slots(make_request("a", list(range(8))), 8)
    assert quiet.take_events() == []
    loud = BlockPool(64, BS, enable_events=True, max_queued_events=2)
    kv = KVCacheManager(loud)
    for i in range(4):
        kv.allocate_slots(make_request(f"r{i}", [i * 100 + t for t in range(4)]), 4)
    assert len(loud.take_events()) == 2 and loud.events_dropped == 2


def test_stored_events_are_unbroken_chains_when_a_middle_hash_is_already_cached():
    pool = BlockPool(8, BS, enable_events=True)
    h0, h1, h2 = make_request("x", list(range(12))).full_block_hashes(BS)
    (other,) = pool.get_new_blocks(1)
    pool.cache_blocks([other], [h1], parent=h0)  # someone else computed block 1 already
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks, [h0, h1, h2], parent=None)
    assert pool.take_events() == [
        BlockStored(hashes=(h1,), parent=h0, block_size=BS),
        BlockStored(hashes=(h0,), parent=None, block_size=BS),
        BlockStored(hashes=(h2,), parent=h1, block_size=BS),
    ]
    assert blocks[1].block_hash is None and pool.get_cached_block(h1) is other


def test_a_sliding_window_releases_the_blocks_it_has_passed():
    """window 6, blocks of 4: the token at position p sees keys from p - 5, so block j goes once
    every one of its tokens is below that. Released blocks stay cached (a later hit finds them);
    their table slots hold the null block, which no table counts and no one caches."""
    kv = KVCacheManager(BlockPool(8, BS), window=6)
    null = kv.null_block.block_id
    a = make_request("a", list(range(10)), n=2)
    kv.allocate_slots(a, 10)  # blocks 1, 2, 3 (0 is the null block)
    a.num_computed_tokens = 10
    child = a.fork(1, "a\x1f1")  # shares every block, one more reference each
    kv.fork(a, child)
    a.append_output(99)
    # position 10 sees 5..10: block 0 (tokens 0-3) is passed; the shared partial block is copied
    assert kv.allocate_slots(a, 1) == [(3, 4)]
    assert kv.block_ids(a) == [null, 2, 4] and kv.block_ids(child) == [1, 2, 3] and kv.window_released == 1
    assert kv.pool.blocks[1].ref_cnt == 1  # the child's reference only
    kv.check_integrity()
    child.append_output(98)
    kv.allocate_slots(child, 1)
    assert kv.block_ids(child) == [null, 2, 3] and kv.pool.num_free == 8 - 4  # null, 2, 3, 4 held
    assert kv.pool.num_cached == 2  # tokens 0-7 still cached after both released block 0
    kv.free(child)
    a.num_computed_tokens = 11
    for token in range(100, 106):
        a.append_output(token)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert kv.block_ids(a)[:2] == [null, null] and len(kv.block_ids(a)) == 5  # 17 tokens, 3 blocks held
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_usable_blocks == 7


def test_without_a_window_nothing_is_released_and_no_block_is_reserved():
    kv = KVCacheManager(BlockPool(8, BS))
    a = make_request("a", list(range(30)))
    kv.allocate_slots(a, 30)
    a.num_computed_tokens = 30
    a.append_output(1)
    kv.allocate_slots(a, 1)
    assert kv.block_ids(a) == list(range(8)) and kv.null_block is None and kv.num_usable_blocks == 8


def test_a_prefix_hit_under_a_window_adopts_only_the_blocks_its_window_reads():
    """A multi-turn chat under a window: the next turn hits 8 cached blocks, of which only those
    its first new token's window reads are adopted (the rest stay cached and free, their slots the
    null block), so it fits the pool sized for one windowed request instead of waiting forever."""
    from kvharbor.engine.kv.capacity import blocks_for_one_request

    kv = KVCacheManager(BlockPool(9, BS), window=6)
    first = make_request("a", list(range(32)))
    for _ in range(4):  # 8-token steps
        assert kv.allocate_slots(first, 8) is not None
        first.num_computed_tokens += 8
    kv.free(first)  # its 8 full blocks stay cached
    follow_up = make_request("b", list(range(40)))
    assert blocks_for_one_request(40, BS, 6, 8) <= 9  # the pool was sized for this request
    hit = kv.get_computed_blocks(follow_up)
    assert len(hit.blocks) == 8 and kv.blocks_needed(follow_up, 8, hit) <= kv.num_free_blocks
    assert kv.allocate_slots(follow_up, 8, hit) == []
    null = kv.null_block.block_id
    # position 32 sees keys from 27: blocks 0-5 (tokens 0-23) are passed, 6 and 7 adopted
    assert kv.block_ids(follow_up)[:6] == [null] * 6 and null not in kv.block_ids(follow_up)[6:]
    assert kv.prefix_hits == 32 and kv.pool.num_cached == 8  # 2 passed blocks evicted for the 2 new ones
    kv.check_integrity()
    kv.free(follow_up)
    kv.check_integrity()
    assert kv.pool.num_free == kv.num_usable_blocks
