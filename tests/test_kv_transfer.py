"""KV blocks leave one engine as bytes and enter another's prefix cache: the second engine then
skips their prefill and produces exactly the tokens it would have computed itself."""

from __future__ import annotations

import pytest
import torch

from kvharbor.common.block_hash import block_hashes
from kvharbor.engine import SamplingParams
from kvharbor.engine.kv.kv_transfer import KVBlockIO, weights_fingerprint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt_hashes(llm, prompt: list[int]) -> list[bytes]:
    engine = llm.engine
    return block_hashes(prompt, engine.core.pool.block_size, engine.core.model_name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_imported_blocks_skip_prefill_and_change_nothing(tiny_llama, make_llm, dtype):
    prompt = [(i * 37) % 500 + 3 for i in range(200)]
    a = make_llm(tiny_llama.loaded, dtype=dtype)
    b = make_llm(tiny_llama.loaded, dtype=dtype)
    fresh = make_llm(tiny_llama.loaded, dtype=dtype)
    want = fresh.generate([prompt], GREEDY)[0].outputs[0].token_ids

    a.generate([prompt], GREEDY)
    hashes = prompt_hashes(a, prompt)
    blocks = [a.engine.core.pool.cached[h].block_id for h in hashes]
    payloads = a.engine.core.kv_io.export(blocks)
    assert len(payloads) == len(hashes) == 200 // a.engine.core.pool.block_size

    assert b.engine.core.import_prefix(hashes, payloads) == len(hashes)
    assert b.engine.core.import_prefix(hashes, payloads) == 0  # already cached
    b.engine.core.check_integrity()
    out = b.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == len(hashes) * b.engine.core.pool.block_size  # prefill skipped
    assert out.outputs[0].token_ids == want


def test_import_of_a_chain_tail_links_to_local_blocks(tiny_llama, make_llm):
    prompt = [(i * 11) % 500 + 3 for i in range(170)]  # 10 full blocks and a tail
    a = make_llm(tiny_llama.loaded)
    b = make_llm(tiny_llama.loaded)
    a.generate([prompt], GREEDY)
    b.generate([prompt[:64]], GREEDY)  # b holds the first blocks itself
    hashes = prompt_hashes(a, prompt)
    local = sum(h in b.engine.core.pool.cached for h in hashes)
    assert 0 < local < len(hashes)
    tail = hashes[local:]
    payloads = a.engine.core.kv_io.export([a.engine.core.pool.cached[h].block_id for h in tail])
    assert b.engine.core.import_prefix(tail, payloads, hashes[:local]) == len(tail)
    out = b.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == len(hashes) * b.engine.core.pool.block_size


def test_export_load_roundtrip_and_bad_payloads():
    kv = torch.randn(3, 2, 2, 8 * 4, 5).to(torch.bfloat16)
    io = KVBlockIO(kv, block_size=4, model="m", fingerprint="f")
    assert io.format.layout == "hm1:L3:H2:D5:B4" and io.format.dtype == "bfloat16"
    assert io.format.block_bytes == 3 * 2 * 2 * 4 * 5 * 2
    payloads = io.export([5, 1])
    before = kv.clone()
    io.load([0, 7], payloads)
    view = kv.view(3, 2, 2, 8, 4, 5)
    assert torch.equal(view[:, :, :, 0], before.view(3, 2, 2, 8, 4, 5)[:, :, :, 5])
    assert torch.equal(view[:, :, :, 7], before.view(3, 2, 2, 8, 4, 5)[:, :, :, 1])
    assert torch.equal(view[:, :, :, 2], before.view(3, 2, 2, 8, 4, 5)[:, :, :, 2])  # untouched
    with pytest.raises(ValueError, match="bytes"):
        io.load([0], [b"short"])
    with pytest.raises(ValueError, match="payloads"):
        io.load([0, 1], payloads[:1])


def test_fingerprint_tells_weights_apart():
    w = {"a": torch.randn(10, 10), "b": torch.randn(7)}
    same = {k: v.clone() for k, v in w.items()}
    other = {**w, "b": w["b"] + 1e-3}
    assert weights_fingerprint(w) == weights_fingerprint(same)
    assert weights_fingerprint(w) != weights_fingerprint(other)
