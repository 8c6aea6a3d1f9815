"""Prepacked oneDNN linears: they agree with F.linear, the engine uses them in bfloat16 on CPU,
and answers do not change."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kvharbor.engine import SamplingParams
from kvharbor.engine.cpu import cpu_linear

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
    assert isinstance(packed.engine.core.model.layers[0].fast["qkv"], functools.partial)  # the oneDNN pack
    assert plain.engine.core.model.layers[0].fast["qkv"] is None
    a, b = packed.chat(question, params)[0].outputs[0], plain.chat(question, params)[0].outputs[0]
    assert isinstance(plain.engine.core.model.head, cpu_linear.WidenedLinear)
    assert a.text == b.text == "The capital of France is Paris."
    assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=0.1)


@pytest.mark.parametrize("options", [{}, {"cpu_kernels": False}, {"batch_invariant": "off"}],
                         ids=["kernels", "no-kernels", "onednn"])  # fmt: skip
def test_bfloat16_logits_are_float32_sums(tiny_llama, make_llm, options):
    """Logits rounded to bfloat16 sit on its grid (steps of 0.125 at 16-32) and tie near-equal
    tokens; the final norm and LM head run in float32, so they are off that grid, and as near
    the float64 product of the same final hidden rows as float32 rounding allows."""
    llm = make_llm(tiny_llama.loaded, dtype="bfloat16", **options)
    model, captured = llm.engine.core.model, []
    original = model.logits

    def recording(hidden):
        captured.append(hidden.detach().clone())
        return original(hidden)

    model.logits = recording
    llm.generate([tiny_llama.prompts[3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    hidden = torch.cat(captured)
    got = original(hidden)
    assert got.dtype == torch.float32 and hidden.dtype == torch.float32
    assert (got != got.bfloat16().float()).float().mean() > 0.9  # float32 values, not bfloat16 ones
    h = F.rms_norm(hidden.double(), (hidden.shape[-1],), model.norm.double(), model.arch.rms_norm_eps)
    want = F.linear(h, model.head_weight().double())
    assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_cpu_has_no_float32_output_gemm_so_the_head_widens_without_the_kernels():
    # torch.mm(out_dtype=float32) runs on CUDA only; on CPU the head takes the kernel or widens.
    assert not cpu_linear.mm_float32_out(torch.device("cpu"), torch.bfloat16)
    w = torch.randn(40, 16).bfloat16()
    head = cpu_linear.float32_head(w, None, None)
    assert isinstance(head, cpu_linear.WidenedLinear)
    x = torch.randn(3, 16)
    assert torch.allclose(head(x, None).double(), x.double() @ w.double().t(), atol=1e-5)
