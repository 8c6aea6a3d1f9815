"""The batch-invariant integer GEMM over packed quantized weights (engine/cpu/csrc/packed_int.c,
AVX512-VNNI): against a float64 product of the same 16-bit codes of x, and within a 250th of the
int8 codes' error of float32 x; each row's bits the same
alone, among 7 and 127 others, in chunks of every size and on one thread or two; the layout's
refusals; and a batch-invariant quantized model keeping only the packed copies. On a CPU without
AVX512-VNNI (Zen 3) only the refusals run: there the integer tiles serve (test_quantize.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO, assert_rows_alone

from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.quantize import GROUP, QuantLinear, quantize, quantize_int4, quantize_q8

KERNELS = cpu_kernels.load(2)
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the AVX2 kernels cannot run or build here")
FORMATS = {"int8": lambda w: quantize(w, "int8"), "q4": quantize_int4, "q8": quantize_q8}
needs_vnni = pytest.mark.skipif(
    KERNELS is None or not KERNELS.int_packs(), reason="no AVX512-VNNI here (or the linears on 8 lanes)"
)


WIDE_CODES = 32512  # cpu_kernels.c: x's largest 16-bit code


def x_codes(x: torch.Tensor, top: int = WIDE_CODES) -> tuple[torch.Tensor, torch.Tensor]:
    """x's codes and their scales per group of 32, as cpu_kernels.c fill_xwide makes them (float32:
    top / amax, x times it rounded to nearest even; top 127: the integer tiles' int8 codes)."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    # a true division: torch's `top / amax` multiplies by amax's reciprocal, a rounding the kernel lacks
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inv)
    return codes, torch.where(amax > 0, amax / top, torch.ones_like(amax))


def reference(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """x's codes times the dequantized weight in float64, and how far float32 may be from it: each
    group's exact integer sum rounded by one multiply and two FMAs (three with q4's mins term)."""
    codes, d = x_codes(x)
    xq = (codes.double() * d.double()).reshape(x.shape)
    dense = w.dequantize().double()
    groups = x.shape[1] // GROUP
    bound = 4 * (groups + 1) * 2.0**-24 * (xq.abs() @ dense.abs().T) + 1e-6
    if w.mins is not None:  # the mins' term, min * (d * sum of codes), is its own rounding
        sums = (codes.double() * d.double()).sum(-1).abs()
        bound = bound + 4 * (groups + 1) * 2.0**-24 * (sums @ w.mins.double().abs().T)
    return xq @ dense.T, bound


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(24, 576), (19, 96), (33, 32), (100, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 130])
def test_the_integer_gemm_matches_float64_on_the_same_codes(fmt, n, k, rows):
    gen = torch.Generator().manual_seed(n * 31 + k + rows)
    w = FORMATS[fmt](torch.randn(n, k, generator=gen))
    packed = KERNELS.pack_quant(w)
    panel = KERNELS._lib.kvharbor_qpacked_panel_bytes(cpu_kernels.QUANT_FORMATS[fmt], k)  # the C side's layout
    assert packed.data.shape == (-(-n // 32), panel) and panel == cpu_kernels.quant_panel_bytes(fmt, k)
    assert packed.nbytes * n == w.nbytes * (-(-n // 32) * 32)  # the weight's own bytes, padding columns aside
    wide = torch.randn(rows, k + 5, generator=gen)
    x = wide[:, 2 : 2 + k]  # rows strided, as a slice of a fused projection's output
    x[0, :GROUP] = 0  # an all-zero group: scale 1, codes 0
    bias = torch.randn(n, generator=gen)
    want, bound = reference(x, w)
    got = KERNELS.linear_qpacked(x, packed, bias)
    assert ((got.double() - bias.double() - want).abs() <= bound).all()
    assert ((KERNELS.linear_qpacked(x, packed).double() - want).abs() <= bound).all()


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_sixteen_bit_codes_keep_x_near_float32(fmt):
    """Against float32 x itself, the product errs by x's rounding: within max|x_g| / 65,024 per
    element, 256 times finer than the int8 codes' max|x_g| / 254 (their error is measured here too)."""
    gen = torch.Generator().manual_seed(4)
    w = FORMATS[fmt](torch.randn(64, 576, generator=gen))
    x = torch.randn(20, 576, generator=gen)
    exact = x.double() @ w.dequantize().double().T
    step = x.double().reshape(20, -1, GROUP).abs().amax(-1)
    dense = w.dequantize().double().abs().reshape(64, -1, GROUP).sum(-1)
    wide = (KERNELS.linear_qpacked(x, KERNELS.pack_quant(w)).double() - exact).abs()
    assert (wide <= step / (2 * WIDE_CODES) @ dense.T + 1e-4).all()
    int8 = (KERNELS.linear_quant(x, w).double() - exact).abs()
    assert wide.max() * 50 < int8.max()


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(fmt):
    """Alone, among 7 and 127 others, in chunks of every size from 1 to 25 (every tile height and
    its tails), past one block of rows (84 at k = 1,536: two bytes of codes per k), and on one
    thread against two."""
    gen = torch.Generator().manual_seed(11)
    w = FORMATS[fmt](torch.randn(200, 1536, generator=gen))
    packed, bias = KERNELS.pack_quant(w), torch.randn(200, generator=gen)
    x = torch.randn(200, 1536, generator=gen)
    assert_rows_alone(KERNELS, lambda rows: KERNELS.linear_qpacked(rows, packed, bias), x)


@needs_vnni
def test_bad_inputs_are_refused_with_what_was_given():
    w = quantize_int4(torch.randn(40, 64))
    packed = KERNELS.pack_quant(w)
    with pytest.raises(ValueError, match=r"x \[m, 64\]"):
        KERNELS.linear_qpacked(torch.zeros(2, 96), packed)
    with pytest.raises(ValueError, match="float32"):
        KERNELS.linear_qpacked(torch.zeros(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"bias of \[40\]"):
        KERNELS.linear_qpacked(torch.zeros(2, 64), packed, torch.zeros(39))  # would read past its end
    with pytest.raises(ValueError, match="lays it out"):  # a q8 layout claimed as q4: refused when made
        cpu_kernels.QuantPacked(KERNELS.pack_quant(quantize_q8(torch.randn(40, 64))).data, "q4", 40, 64)
    with pytest.raises(ValueError, match="multiple of 32"):  # int8 rows of 100: no whole groups
        KERNELS.pack_quant(quantize(torch.randn(8, 100), "int8"))
    assert KERNELS.linear_qpacked(torch.zeros(0, 64), packed).shape == (0, 40)


def test_where_the_microkernel_cannot_run_packing_is_refused_and_the_tiles_serve():
    """On 8 lanes (the AVX2 build's width; Zen 3 has no other) pack_quant says what to do instead,
    a weight packed on 16 lanes is refused by the call, and an invariant QuantLinear keeps its
    row-major weight on the integer tiles."""
    before = KERNELS.lanes()
    w = quantize_int4(torch.randn(40, 64))
    packed = KERNELS.pack_quant(w) if KERNELS.int_packs() else None
    try:
        KERNELS.lanes(8)
        assert not KERNELS.int_packs()
        with pytest.raises(ValueError, match="linear_quant instead"):
            KERNELS.pack_quant(w)
        if packed is not None:
            with pytest.raises(ValueError, match="no integer microkernel"):
                KERNELS.linear_qpacked(torch.zeros(2, 64), packed)
        linear = QuantLinear(KERNELS, w, 16, invariant=True)
        assert linear.int_packed is None and linear.weight is w
        x = torch.randn(40, 64)
        tiles = torch.cat([KERNELS.linear_quant(x[:32], w), KERNELS.linear_quant(x[32:], w)])
        assert torch.equal(linear(x, None), tiles)
    finally:
        KERNELS.lanes(before)


@needs_vnni
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("case", ["tiny_llama", "tiny_qwen2"])  # an LM head of its own, a tied one
def test_a_quantized_model_keeps_only_the_packed_copies(mode, case, make_llm, request):
    """Every projection and the LM head run on their packed copies alone (the row-major codes
    released: the engine holds the bytes an 8-lane engine holds, no more), with the mode on or
    off; a tied embedding reads its rows from the packed head, the q8 head's values."""
    model_case = request.getfixturevalue(case)
    llm = make_llm(model_case.loaded, quantization=mode)
    assert llm.engine.core.batch_invariant  # auto: on, since the mode costs nothing here
    model = llm.engine.core.model
    fasts = [f for layer in model.layers for f in layer.fast.values()] + [model.lm_head_fast]
    assert all(f.int_packed is not None and f.weight is None for f in fasts) and model.head_blocks is None
    before = KERNELS.lanes()
    try:
        KERNELS.lanes(8)  # the row-major quantized weights, as a CPU without the packed GEMM keeps them
        rowmajor = make_llm(model_case.loaded, quantization=mode).engine.core.model
    finally:
        KERNELS.lanes(before)
    assert rowmajor.lm_head_fast.int_packed is None and model.weight_bytes() == rowmajor.weight_bytes()
    ids = torch.tensor(model_case.prompts[0])
    if model.arch.tie_word_embeddings:
        head = quantize_q8(model_case.hf.get_input_embeddings().weight.detach().float())
        assert model.embed_blocks is None and torch.equal(model._embed(ids), head.dequantize(ids))
    off = make_llm(model_case.loaded, quantization=mode, batch_invariant="off").engine.core.model
    assert all(f.int_packed is not None for layer in off.layers for f in layer.fast.values())


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_weights_rows_are_its_dequantized_rows(fmt):
    """QuantPacked.rows (a tied embedding's lookups) gives QuantWeight.dequantize's bits, the last
    partial panel included; an id outside the weight is refused, as F.embedding refuses it."""
    w = FORMATS[fmt](torch.randn(70, 96, generator=torch.Generator().manual_seed(8)))
    packed = KERNELS.pack_quant(w)
    ids = torch.tensor([0, 69, 31, 32, 33, 64, 5, 5])
    assert torch.equal(packed.rows(ids), w.dequantize(ids))
    assert torch.equal(packed.rows(torch.arange(70)), w.dequantize())
    for bad in (70, -1):
        with pytest.raises(IndexError, match=r"\[0, 70\)"):
            packed.rows(torch.tensor([3, bad]))


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_x_gives_non_finite_outputs_and_tiny_groups_count_as_zero(fmt):
    """A NaN in a row makes its outputs NaN and an inf makes them inf or NaN (as float products
    would, not finite garbage), and the other rows are left alone; a group whose values are all below ~1e-34
    contributes nothing (its scale would be infinite)."""
    w = FORMATS[fmt](torch.randn(40, 96, generator=torch.Generator().manual_seed(9)))
    packed = KERNELS.pack_quant(w)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(10))
    clean = KERNELS.linear_qpacked(x, packed)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    got = KERNELS.linear_qpacked(x, packed)
    assert got[1].isnan().all() and not got[2].isfinite().any()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[3], clean[3])
    tiny = x[3].clone()
    tiny[:32] = 1e-36
    want = KERNELS.linear_qpacked(torch.cat([torch.zeros(32), tiny[32:]])[None], packed)
    assert torch.equal(KERNELS.linear_qpacked(tiny[None], packed), want)


@needs_vnni
def test_auto_leaves_the_mode_off_where_a_projection_cannot_pack(tmp_path, make_llm):
    """int8 weights may have an input width that is not a multiple of 32 (here the MLP's 112): that
    projection stays on the integer tiles, which run invariant in 32-row slices at 4x the time, so
    `auto` keeps the mode off; `on` still runs it."""
    from tiny_models import TINY, hf_model

    from kvharbor.engine.model.loader import load_model

    hf_model("llama", 11, **{**TINY, "intermediate_size": 112}, tie_word_embeddings=False).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    model = make_llm(loaded, quantization="int8")
    assert not model.engine.core.batch_invariant
    layer = model.engine.core.model.layers[0]
    assert layer.fast["gate_up"].int_packed is not None and layer.fast["down"].int_packed is None
    assert make_llm(loaded, quantization="int8", batch_invariant="on").engine.core.batch_invariant


@needs_vnni
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("case", ["tiny_llama", "tiny_qwen2"])
def test_a_packed_engine_is_near_float32_on_its_own_weights(mode, case, make_llm, request):
    """Teacher-forced logits of prompt (prefill) and decode positions against transformers on the
    same dequantized weights: within 0.02 (measured: at most 0.004), where the integer tiles' int8
    activations moved them by 0.17-0.57 on the same prompts (test_quantize.py allows 0.6-1.05)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from quality import teacher_forced_logits  # the quality ledger's measure
    from test_quantize import dequantized_copy

    from kvharbor.engine.model.hf_reference import hf_reference_model

    model_case = request.getfixturevalue(case)
    llm = make_llm(model_case.loaded, quantization=mode)
    reference = hf_reference_model(dequantized_copy(model_case.loaded, mode))
    for prompt in model_case.prompts[:3]:
        got = teacher_forced_logits(llm, prompt, 5)  # the last 5 positions one decode step each
        want = reference(torch.tensor([prompt])).logits[0].float()
        assert (got - want).abs().max() <= 0.02
