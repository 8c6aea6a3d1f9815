"""KV moves are fields of the scheduler's plan, carried out by the runner around its forward:
copy-outs of blocks about to be overwritten happen before it, of blocks it fills after it, and
imported blocks are written before it. Nothing moves KV inside scheduling."""

from __future__ import annotations

import pytest

from kvharbor.common.block_hash import block_hashes
from kvharbor.engine import SamplingParams
from kvharbor.engine.kv.block_pool import BlockPool
from kvharbor.engine.request import FinishReason

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
H = [bytes([i]) * 16 for i in range(8)]


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 131 + i * 17) % 500 + 3 for i in range(n)]


def test_the_pool_records_saves_by_kind_and_hands_them_over_once():
    pool = BlockPool(4, 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, H[:2], None)
    assert pool.take_saves() == ([], [])  # recording is off by default
    pool.free_blocks(blocks)
    pool.save_on = frozenset({"evict", "reuse", "fill"})
    pool.touch([blocks[0]])
    pool.reused([blocks[0]])
    fresh = pool.get_new_blocks(3)  # the two uncached blocks, then the cached blocks[1]
    pool.cache_blocks(fresh[:1], H[2:3], None)
    before, after = pool.take_saves()
    assert before == [(blocks[0].block_id, H[0]), (blocks[1].block_id, H[1])]
    assert after == [(fresh[0].block_id, H[2])]
    assert pool.take_saves() == ([], [])
    pool.free_blocks([blocks[0], *fresh])
    pool.check_integrity()


def test_an_evicted_block_is_copied_out_before_the_forward_overwrites_it(tiny_llama, make_llm):
    # 12 blocks: the second prompt's 7 blocks evict the first prompt's tail.
    llm = make_llm(tiny_llama.loaded, num_kv_blocks=12, max_model_len=192, kv_save="evict")
    engine = llm.engine
    first = prompt(1)
    llm.generate([first], GREEDY)
    hashes = block_hashes(first[:-1], 16, engine.core.model_name)
    cached = [engine.core.pool.cached[h].block_id for h in hashes]
    intact = dict(zip(hashes, engine.core.kv_io.export(cached), strict=True))
    llm.generate([prompt(2)], GREEDY)
    saved = engine.core.kv_saves.queued()  # each block's KV, copied the moment the runner handed it over
    assert saved and all(h in intact for h, _ in saved)
    assert all(payload == intact[h] for h, payload in saved)  # the first prompt's KV, not the second's


def test_blocks_a_step_fills_are_copied_out_after_its_forward(tiny_llama, make_llm):
    llm = make_llm(tiny_llama.loaded, kv_save="all")  # "all": every block a forward fills
    engine = llm.engine
    text = prompt(3, 70)
    llm.generate([text], GREEDY)
    saved = engine.core.kv_saves.queued()
    hashes = block_hashes(text[:64], 16, engine.core.model_name)
    assert [h for h, _ in saved] == hashes
    # What was saved is what the forward wrote: a fresh engine importing it skips the prefill
    # and generates the same tokens.
    other = make_llm(tiny_llama.loaded)
    want = make_llm(tiny_llama.loaded).generate([text], GREEDY)[0].outputs[0].token_ids
    assert other.engine.core.import_prefix(hashes, [p for _, p in saved]) == 4
    out = other.generate([text], GREEDY)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == want


def test_imports_ride_the_next_plan_and_are_held_until_written(tiny_llama, make_llm):
    a, b = make_llm(tiny_llama.loaded), make_llm(tiny_llama.loaded)
    text = prompt(4, 40)
    a.generate([text], GREEDY)
    hashes = block_hashes(text[:32], 16, a.engine.core.model_name)
    payloads = a.engine.core.kv_io.export([a.engine.core.pool.cached[h].block_id for h in hashes])
    kv = b.engine.core.kv
    assert b.engine.core.import_prefix(hashes, payloads) == 2
    assert kv.cached_run(hashes) == 2 and b.engine.core.pool.num_free == b.engine.core.pool.num_blocks - 2  # held
    kv.check_integrity()
    assert b.engine.has_unfinished()  # no request, but the held blocks need a step to be written
    plan = b.engine.core.scheduler.schedule()
    assert [load.payload for load in plan.loads] == payloads and plan.is_empty and plan.moves_kv
    b.engine.core.runner.execute(plan)
    kv.loaded()
    assert b.engine.core.pool.num_free == b.engine.core.pool.num_blocks  # released, still cached
    assert kv.cached_run(hashes) == 2 and not b.engine.has_unfinished()
    kv.check_integrity()


def test_an_import_whose_request_is_refused_is_still_written_and_released(tiny_llama, make_llm):
    a, b = make_llm(tiny_llama.loaded), make_llm(tiny_llama.loaded)
    text = prompt(7, 40)
    a.generate([text], GREEDY)
    hashes = block_hashes(text[:32], 16, a.engine.core.model_name)
    blocks = [a.engine.core.pool.cached[h].block_id for h in hashes]
    b.engine.core.import_prefix(hashes, a.engine.core.kv_io.export(blocks))
    with pytest.raises(ValueError):
        b.engine.add_request("bad", prompt_token_ids=[10**9])  # the engine loop imports, then adds
    while b.engine.has_unfinished():
        b.engine.step()
    assert b.engine.core.pool.num_free == b.engine.core.pool.num_blocks and b.engine.core.kv.cached_run(hashes) == 2


def test_a_failed_load_forgets_the_imported_hashes_and_fails_only_its_step(tiny_llama, make_llm, monkeypatch):
    a, b = make_llm(tiny_llama.loaded), make_llm(tiny_llama.loaded)
    text = prompt(5, 40)
    a.generate([text], GREEDY)
    hashes = block_hashes(text[:32], 16, a.engine.core.model_name)
    payloads = a.engine.core.kv_io.export([a.engine.core.pool.cached[h].block_id for h in hashes])
    b.engine.core.import_prefix(hashes, payloads)

    def broken(block_ids, data):
        raise RuntimeError("device lost")

    monkeypatch.setattr(b.engine.core.kv_io, "load", broken)
    out = b.generate([text], GREEDY)[0]
    assert out.outputs[0].finish_reason == FinishReason.ERROR.value
    assert b.engine.core.kv.cached_run(hashes) == 0  # nobody may hit KV that was never written
    monkeypatch.undo()
    again = b.generate([text], GREEDY)[0]  # the engine goes on, computing the prefill itself
    want = a.generate([text], GREEDY)[0].outputs[0].token_ids
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want


def test_bad_imports_are_refused_whole(tiny_llama, make_llm):
    llm = make_llm(tiny_llama.loaded)
    size = llm.engine.core.kv_io.format.block_bytes
    with pytest.raises(ValueError, match="2 hashes but 1 payloads"):
        llm.engine.core.import_prefix(H[:2], [b"x" * size])
    with pytest.raises(ValueError, match=f"expected {size}"):
        llm.engine.core.import_prefix(H[:2], [b"x" * size, b"short"])
    assert llm.engine.core.pool.num_cached == 0
    llm.engine.core.check_integrity()


def test_no_kv_moves_without_a_store(tiny_llama, make_llm):
    llm = make_llm(tiny_llama.loaded)
    plans = []
    execute = llm.engine.core.runner.execute

    def spy(plan):
        plans.append(plan)
        return execute(plan)

    llm.engine.core.runner.execute = spy
    llm.generate([prompt(6)], GREEDY)
    assert plans and not any(p.moves_kv for p in plans)
