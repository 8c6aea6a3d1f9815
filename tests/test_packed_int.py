"""The batch-invariant integer GEMM over packed quantized weights (engine/cpu/csrc/packed_int.c,
AVX512-VNNI): against a float64 product of the same int8 codes of x, each row's bits the same
alone, among 7 and 127 others, in chunks of every size and on one thread or two; the layout's
refusals; and a batch-invariant quantized model keeping only the packed copies. On a CPU without
AVX512-VNNI (Zen 3) only the refusals run: there the integer tiles serve (test_quantize.py)."""

from __future__ import annotations

import pytest
import torch

from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.quantize import GROUP, QuantLinear, quantize, quantize_int4, quantize_q8

KERNELS = cpu_kernels.load(2)
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the AVX2 kernels cannot run or build here")
FORMATS = {"int8": lambda w: quantize(w, "int8"), "q4": quantize_int4, "q8": quantize_q8}
needs_vnni = pytest.mark.skipif(KERNELS is None or not KERNELS.int_packs(), reason="no AVX512-VNNI on this CPU")


def x_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes and their scales per group of 32, as cpu_kernels.c fill_xcodes makes them
    (float32: 127 / amax, x times it rounded to nearest even)."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inv)
    return codes, torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))


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
    assert packed.data.shape == (-(-n // 32), k // GROUP, cpu_kernels.quant_group_bytes(fmt == "q4"))
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
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(fmt):
    """Alone, among 7 and 127 others, in chunks of every size from 1 to 25 (every tile height and
    its tails), past one block of rows (170 at k = 1,536), and on one thread against two."""
    gen = torch.Generator().manual_seed(11)
    w = FORMATS[fmt](torch.randn(200, 1536, generator=gen))
    packed, bias = KERNELS.pack_quant(w), torch.randn(200, generator=gen)
    x = torch.randn(200, 1536, generator=gen)
    whole = KERNELS.linear_qpacked(x, packed, bias)
    for row in (0, 5, 77, 127, 199):
        assert torch.equal(KERNELS.linear_qpacked(x[row : row + 1], packed, bias)[0], whole[row])
        eight = torch.cat([x[row : row + 1], x[:7]])
        assert torch.equal(KERNELS.linear_qpacked(eight, packed, bias)[0], whole[row])
        assert torch.equal(KERNELS.linear_qpacked(x[row : row + 128], packed, bias)[0], whole[row])
    for size in range(1, 26):
        chunks = [KERNELS.linear_qpacked(part, packed, bias) for part in x.split(size)]
        assert torch.equal(torch.cat(chunks), whole), size
    threads = KERNELS.threads
    try:
        KERNELS._lib.kvharbor_set_threads(1)
        assert torch.equal(KERNELS.linear_qpacked(x, packed, bias), whole)
    finally:
        KERNELS._lib.kvharbor_set_threads(threads)


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
        cpu_kernels.QuantPacked(KERNELS.pack_quant(quantize_q8(torch.randn(40, 64))).data, True, 40, 64)
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
        linear = QuantLinear(KERNELS, w, 16, invariant=True, pack=True)
        assert linear.int_packed is None and linear.weight is w
        x = torch.randn(40, 64)
        tiles = torch.cat([KERNELS.linear_quant(x[:32], w), KERNELS.linear_quant(x[32:], w)])
        assert torch.equal(linear(x, None), tiles)
    finally:
        KERNELS.lanes(before)


@needs_vnni
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_batch_invariant_quantized_model_keeps_only_the_packed_copies(mode, tiny_llama, make_llm):
    """Every projection runs on its packed copy alone (the row-major codes released); the LM head
    keeps its own on the integer tiles (a tied embedding reads its rows); the mode off packs none."""
    llm = make_llm(tiny_llama.loaded, batch_invariant="on", quantization=mode)
    model = llm.engine.core.model
    fasts = [f for layer in model.layers for f in layer.fast.values()]
    assert all(f.int_packed is not None and f.weight is None for f in fasts)
    assert model.lm_head_fast.int_packed is None and model.lm_head_fast.weight is model.head_blocks
    layer = model.layers[0]
    x = torch.randn(9, layer.fast["down"].int_packed.k)
    assert torch.equal(layer.fast["down"](x, None), KERNELS.linear_qpacked(x, layer.fast["down"].int_packed))
    off = make_llm(tiny_llama.loaded, batch_invariant="off", quantization=mode).engine.core.model
    assert all(f.int_packed is None for layer in off.layers for f in layer.fast.values())
