"""Prepacked oneDNN linears: they agree with F.linear, the engine uses them in bfloat16 on CPU,
and answers do not change."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kvharbor.engine import SamplingParams, cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.packing_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN prepacking here"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_agrees_with_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 96, generator=gen).bfloat16()
    b = torch.randn(192, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    got = cpu_linear.packed_linear(x, cpu_linear.pack(w), b).float()
    want = F.linear(x.float(), w.float(), b.float())
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_only_cpu_bfloat16_and_float32_are_packed():
    assert not cpu_linear.packing_available(torch.float16, torch.device("cpu"))
    assert not cpu_linear.packing_available(torch.bfloat16, torch.device("meta"))


def test_the_engine_packs_in_bfloat16_and_answers_the_same(smollm, make_llm):
    # France: its float32 logits of "The" and "L" differ by 0.08 at ~25, where bfloat16 steps by
    # 0.125; with logits rounded to bfloat16 the two tied on an AMX machine and the lower token id
    # won ("L'Étoile..."). The LM head now sums and answers in float32 on every path.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=0)
    packed = make_llm(smollm, dtype="bfloat16", batch_invariant="off")
    plain = make_llm(smollm, dtype="bfloat16", cpu_kernels=False)
    assert isinstance(packed.engine.model.layers[0].fast["qkv"], functools.partial)  # the oneDNN pack
    assert plain.engine.model.layers[0].fast["qkv"] is None
    a, b = packed.chat(question, params)[0].outputs[0], plain.chat(question, params)[0].outputs[0]
    assert isinstance(plain.engine.model.head, cpu_linear.WidenedLinear)
    assert a.text == b.text == "The capital of France is Paris."
    assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=0.1)
