"""The batch-invariant packed GEMM (engine/cpu/csrc/packed_gemm.c) on each of its microkernels
(panels 16 wide on AVX2, 32 on AVX-512F where the CPU has it, and bfloat16 k-pairs on AVX512-BF16
where it has that), float32 and bfloat16 weights: against float64, and each row's bits the same
alone, among 7 and 127 others, in chunks of every size and on one thread or two; a packed weight's
rows read back exact, and a batch-invariant model keeping only the packed copies (a tied embedding
read from its LM head's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rows_alone

from kvharbor.common.machine import cpu_info
from kvharbor.engine.cpu import cpu_kernels

KERNELS = cpu_kernels.load(2)
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the AVX2 kernels cannot run or build here")
LANES = [8, 16] if "avx512f" in cpu_info().flags else [8]
SHAPES = [(1, 8), (33, 17), (100, 576), (577, 64), (40, 1536)]  # n % width and odd k included
ROWS = 200  # past one block of rows at k = 1,536 (84), within one at small k
# The packed forms: (weight dtype, k-pairs). "bfloat16-dot" runs only on 16 lanes of a CPU with
# AVX512-BF16 (the `form` fixture skips it elsewhere; the refusal is tested everywhere).
FORMS = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "bfloat16-dot": (torch.bfloat16, True)}


@pytest.fixture(params=LANES, ids=lambda lanes: f"{lanes}-lanes")
def kernels(request):
    before = KERNELS.lanes()
    KERNELS.lanes(request.param)
    yield KERNELS
    KERNELS.lanes(before)


@pytest.fixture(params=list(FORMS))
def form(request, kernels):
    dtype, dot = FORMS[request.param]
    if dot and not kernels.bf16_dot():
        pytest.skip(f"no AVX512-BF16 microkernel on {kernels.lanes()} lanes of this CPU")
    return dtype, dot


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 error a sum over k in order can have: k units of roundoff times sum |x w|."""
    k = x.shape[1]
    return k * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_packed_gemm_matches_float64(kernels, form, n, k):
    dtype, dot = form
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed = kernels.pack(w, dot=dot)
    assert packed.width == (32 if kernels.lanes() == 16 else 16)
    laid_out = (-(-k // 2), 2 * packed.width) if dot else (k, packed.width)
    assert packed.data.shape == (-(-n // packed.width), *laid_out)
    bias = torch.randn(n, generator=gen)
    wide = torch.randn(ROWS, k + 3, generator=gen)
    x = wide[:, 1 : 1 + k]  # rows strided, as a slice of a fused projection's output
    for b in (None, bias):
        got = kernels.linear_packed(x, packed, b)
        taken = x.bfloat16() if dot else x  # k-pairs take x rounded to bfloat16, to nearest even
        want = F.linear(taken.double(), w.double(), None if b is None else b.double())
        assert got.shape == (ROWS, n) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= error_bound(x, w) + 1e-6 * (0 if b is None else 1)).all()


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernels, form):
    """Alone, among 7 and among 127 others, in chunks of every size from 1 to 25, and on one
    thread against two: the same bits. (128 rows round x to bfloat16 on both threads, 8 on one.)"""
    dtype, dot = form
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 1536  # 84 rows a block: 128 rows take two
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed, bias = kernels.pack(w, dot=dot), torch.randn(n, generator=gen)
    x = torch.randn(128, k, generator=gen)
    assert_rows_alone(kernels, lambda rows: kernels.linear_packed(rows, packed, bias), x)


def test_bad_inputs_are_refused_with_what_was_given():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        KERNELS.pack(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        KERNELS.pack(torch.zeros(8))
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        KERNELS.pack(torch.zeros(4, 0))  # no k: nothing to sum
    packed = KERNELS.pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \[m, 8\]"):
        KERNELS.linear_packed(torch.zeros(2, 9), packed)
    with pytest.raises(ValueError, match=r"bias of \[4\]"):
        KERNELS.linear_packed(torch.zeros(2, 8), packed, torch.zeros(3))  # would read past its end
    with pytest.raises(ValueError, match="lays it out"):  # not as pack() lays it out: refused when made
        KERNELS.linear_packed(torch.zeros(2, 8), cpu_kernels.PackedWeight(packed.data[:, :4], 4, 8, packed.width))
    assert KERNELS.linear_packed(torch.zeros(0, 8), packed).shape == (0, 4)


def test_a_packing_on_a_width_the_cpu_lacks_is_refused():
    odd = cpu_kernels.PackedWeight(torch.zeros(1, 8, 24), 4, 8, 24)  # no microkernel is 24 wide
    with pytest.raises(ValueError, match="24 wide"):
        KERNELS.linear_packed(torch.zeros(2, 8), odd)


def test_k_pairs_are_refused_where_they_cannot_run(kernels):
    """A float32 weight has no k-pair form anywhere; on 8 lanes, or a CPU without AVX512-BF16, pack
    makes none and says what to do. A k-pair weight made elsewhere runs wherever the CPU has the
    instruction (its packing picks the microkernel, as a width does), and is refused elsewhere."""
    with pytest.raises(ValueError, match="bfloat16 weight on a CPU with AVX512-BF16"):
        KERNELS.pack(torch.zeros(4, 8), dot=True)
    if not kernels.bf16_dot():
        with pytest.raises(ValueError, match="without dot"):
            kernels.pack(torch.zeros(4, 8, dtype=torch.bfloat16), dot=True)
    pairs = cpu_kernels.PackedWeight(torch.ones(1, 4, 64, dtype=torch.bfloat16), 4, 8, 32, dot=True)
    if {"avx512f", "avx512_bf16"} <= cpu_info().flags:
        assert torch.equal(kernels.linear_packed(torch.ones(2, 8), pairs), torch.full((2, 4), 8.0))
    else:
        with pytest.raises(ValueError, match="no microkernel for bfloat16 k-pair panels"):
            kernels.linear_packed(torch.zeros(2, 8), pairs)


def test_a_packed_weight_gives_back_its_rows(kernels, form):
    """A tied embedding's lookups read the LM head's packed copy: every row comes back exact."""
    dtype, dot = form
    w = torch.randn(77, 41, generator=torch.Generator().manual_seed(3)).to(dtype)  # odd k: a padded pair
    packed = kernels.pack(w, dot=dot)
    ids = torch.tensor([0, 76, 15, 16, 31, 32, 33, 15])
    assert torch.equal(packed.rows(ids), w[ids])
    assert torch.equal(packed.unpack(), w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["tiny_llama", "tiny_qwen2"])  # an LM head of its own, a tied one
def test_a_batch_invariant_model_keeps_only_the_packed_copies(case, dtype, make_llm, request):
    model_case = request.getfixturevalue(case)
    llm = make_llm(model_case.loaded, dtype=dtype, batch_invariant="on")
    model = llm.engine.core.model
    assert all(p.numel() == 0 for layer in model.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert model.lm_head.numel() == 0 and (model.embed.numel() == 0) == model.arch.tie_word_embeddings
    packed = [f.weight.nbytes for layer in model.layers for f in layer.fast.values()]
    packed.append(model.lm_head_fast.weight.nbytes)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.weight_bytes() == sum(packed) + params  # the packed copies, counted once
    ids = torch.tensor(model_case.prompts[0])
    want = model_case.hf.get_input_embeddings().weight[ids].to(getattr(torch, dtype))
    assert torch.equal(model._embed(ids), want)  # a tied embedding read back from the packed head
