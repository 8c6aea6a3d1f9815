"""--quantization int8 and int4: the formats' rounding, every kernel format (int8, q4, q8) against a
float64 product of its dequantized weights (decode rows through the kernel, prefill rows through
dequantized slices and MKL), and engines that compute what float32 computes on those dequantized
weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_near_reference

from kvharbor.common.config import ConfigError, load_config
from kvharbor.engine import SamplingParams
from kvharbor.engine.config import EngineConfig
from kvharbor.engine.cpu.cpu_kernels import load
from kvharbor.engine.model.decoder import QUANT_MAX_ROWS
from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.quantize import (
    INT_ROWS,
    QuantLinear,
    QuantWeight,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_q8,
)

GEMM = load(2)
needs_kernels = pytest.mark.skipif(GEMM is None, reason="no AVX2+FMA kernels on this machine")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# How far x's int8 rounding (engine/quantize.py) moved the tiny models' logits (std 2.0) from a
# float32 product of the same quantized weights: the largest difference, teacher-forced over
# test_a_quantized_engine_generates...'s prompts, both models; tests/test_gguf_blocks.py's for its
# GGUF block types (measured: int8 0.59, int4 0.85, Q4_0 0.58, Q4_1 1.01, Q8_0 0.56).
MAX_LOGIT_MOVE = {"int8": 0.6, "int4": 0.9, "Q4_0": 0.6, "Q4_1": 1.05, "Q8_0": 0.6}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def test_each_weight_is_within_half_a_step_and_zero_rows_survive():
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different ranges
    w[7] = 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and int(q.abs().max()) <= 127
    assert torch.all((QuantWeight("int8", q, scale, None, 70).dequantize() - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q[7] == 0) and scale[7] == 1.0
    assert torch.equal(q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0], torch.full((39,), 127, dtype=torch.int8))


def test_int4_weights_are_within_half_a_step_of_their_group_and_flat_groups_are_exact():
    w = torch.randn(6, 96) * torch.logspace(-3, 1, 6)[:, None]
    w[2, 32:64] = 0.75  # one group of equal values
    qw = quantize_int4(w)
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (6, 48) and qw.scale.shape == qw.mins.shape == (6, 3)
    step = qw.scale.repeat_interleave(32, dim=1)
    assert torch.all((qw.dequantize() - w).abs() <= step / 2 + 1e-6 * w.abs())
    assert torch.equal(qw.dequantize()[2, 32:64], w[2, 32:64])
    assert torch.equal(qw.dequantize(torch.tensor([4, 1])), qw.dequantize()[[4, 1]])  # row selection
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4(torch.randn(4, 40))


def test_q8_weights_are_within_half_a_step_of_their_group():
    w = torch.randn(5, 64) * torch.logspace(-3, 1, 5)[:, None]
    w[1, :32] = 0
    qw = quantize_q8(w)
    step = qw.scale.repeat_interleave(32, dim=1)
    assert torch.all((qw.dequantize() - w).abs() <= step / 2 + 1e-7) and torch.all(qw.dequantize()[1, :32] == 0)


FORMATS = {"int8": lambda w: quantize(w, "int8"), "q4": quantize_int4, "q8": quantize_q8}


def kernel_bound(x: torch.Tensor, dense: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """How far a kernel product x @ dense^T may be from float64's, and why:
    - float32 sums of k products (8 lanes then a tree, or MKL's blocking): ~k * 2^-24 * sum|x*w|,
      plus one rounding of each dequantized weight (the kernel's fma vs the reference's two steps);
    - at up to INT_ROWS rows x is made int8 per group of 32: each element within half a step,
      max|x_g| / 254, of its group, so each group's sum within that times sum|w| over the group;
    - `packed` (the packed integer GEMM, every row count): 16-bit codes, within max|x_g| / 65,024."""
    rows, k = x.shape
    b = (k + 2) * 2.0**-24 * (x.double().abs() @ dense.abs().T) + 1e-6
    if rows <= INT_ROWS or packed:
        step = x.double().reshape(rows, -1, 32).abs().amax(-1) / (65024 if packed else 254)
        b = b + step @ dense.abs().reshape(dense.shape[0], -1, 32).sum(-1).T
    return b


@pytest.fixture
def tiles():
    """The kernels as a CPU without AVX512-VNNI runs quantized weights (the linears on 8 lanes):
    QuantLinear keeps its row-major weight on the integer tiles and dequantized slices."""
    before = GEMM.lanes()
    GEMM.lanes(8)
    yield GEMM
    GEMM.lanes(before)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, QUANT_MAX_ROWS + 7])
@pytest.mark.parametrize(("n", "k"), [(24, 576), (19, 96), (3072, 64)])
def test_each_kernel_format_equals_a_float64_product_of_its_dequantized_weight(fmt, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    qw = FORMATS[fmt](w)
    dense = qw.dequantize().double()
    want = x.double() @ dense.T + bias.double()
    packed = QuantLinear(GEMM, qw, QUANT_MAX_ROWS)  # every row on the packed integer GEMM where it runs
    assert (packed.int_packed is not None) == GEMM.int_packs()
    assert torch.all((packed(x, bias).double() - want).abs() <= kernel_bound(x, dense, GEMM.int_packs()))
    before = GEMM.lanes()
    try:
        GEMM.lanes(8)  # the tiles, and rows above QUANT_MAX_ROWS dequantized + packed GEMM
        got = QuantLinear(GEMM, qw, QUANT_MAX_ROWS)(x, bias)
    finally:
        GEMM.lanes(before)
    assert torch.all((got.double() - want).abs() <= kernel_bound(x, dense))
    strided = torch.randn(rows, 2 * k, generator=g)[:, :k]  # rows of a wider tensor, as attention hands them
    error = (GEMM.linear_quant(strided, qw).double() - strided.double() @ dense.T).abs()
    assert torch.all(error <= kernel_bound(strided, dense))
    assert torch.allclose(GEMM.dequantize(qw, 3, n), qw.dequantize()[3:], rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_rows_that_are_not_whole_groups_keep_float_activations(rows):
    w, x = torch.randn(10, 100), torch.randn(rows, 100)  # 100: no groups of 32, so no int8 x
    qw = quantize(w, "int8")
    dense = qw.dequantize().double()
    bound = 102 * 2.0**-24 * (x.double().abs() @ dense.abs().T) + 1e-6
    assert torch.all((GEMM.linear_quant(x, qw).double() - x.double() @ dense.T).abs() <= bound)


@needs_kernels
def test_a_wide_weight_goes_through_the_packed_gemm_in_bounded_slices(monkeypatch, tiles):
    import kvharbor.engine.quantize as quantize_module

    monkeypatch.setattr(quantize_module, "SCRATCH_FLOATS", 64 * 10)  # ten rows of 64 per slice
    slices = []
    packed = type(GEMM).dequantize_packed
    monkeypatch.setattr(GEMM, "dequantize_packed", lambda w, a, b: slices.append((a, b)) or packed(GEMM, w, a, b))
    qw = quantize_int4(torch.randn(37, 64))
    x, bias = torch.randn(5, 64), torch.randn(37)
    got = QuantLinear(GEMM, qw, max_rows=2)(x, bias)
    assert torch.allclose(got, x @ qw.dequantize().T + bias, atol=1e-4)
    assert GEMM._scratch.numel() >= 640
    assert slices == [(0, 10), (10, 20), (20, 30), (30, 37)]  # slice by slice, never the whole weight


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_slice_dequantizes_straight_into_the_packed_layout(fmt):
    """The same bits as packing the row-major dequantization, the last panel's padding columns
    zero whatever the scratch held before; int8 rows of 100 too (not whole 8-element steps: the
    kernel's row-at-a-time path)."""
    ks = (96, 100) if fmt == "int8" else (96,)
    for k in ks:
        qw = FORMATS[fmt](torch.randn(75, k, generator=torch.Generator().manual_seed(2)))
        for first, last in ((0, 75), (3, 40), (70, 75)):
            want = GEMM.pack(GEMM.dequantize(qw, first, last).clone())
            GEMM._scratch_for(75 * k * 4).fill_(float("nan"))  # stale scratch (dequantize's own buffer)
            got = GEMM.dequantize_packed(qw, first, last)
            assert got.n == last - first and torch.equal(got.data, want.data), (k, first, last)


@needs_kernels
def test_the_kernel_refuses_what_it_does_not_take():
    qw = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(ValueError, match="int8"):
        GEMM.linear_quant(torch.randn(2, 64), QuantWeight("int8", qw.data.to(torch.int16), qw.scale, None, 64))
    with pytest.raises(ValueError, match="float32"):
        GEMM.linear_quant(torch.randn(2, 64, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match=r"\[m, 64\]"):
        GEMM.linear_quant(torch.randn(2, 32), qw)
    q4 = quantize_int4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="mins"):
        GEMM.linear_quant(torch.randn(2, 64), QuantWeight("q4", q4.data, q4.scale, None, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight("q8", torch.zeros(2, 40, dtype=torch.int8), torch.ones(2, 2), None, 40)
    with pytest.raises(ValueError, match="unknown weight format"):
        QuantWeight("q5", qw.data, qw.scale, None, 64)


def dequantized_copy(loaded, mode: str):
    """The same model with every projection replaced by its round trip through `mode`, and the LM
    head (the embedding, when tied) by its q8 round trip, in float32."""
    state = dict(loaded.state_dict)
    head = "model.embed_tokens.weight" if loaded.arch.tie_word_embeddings else "lm_head.weight"
    for name, tensor in state.items():
        if any(name.endswith(p + ".weight") for p in PROJECTIONS):
            state[name] = quantize(tensor, mode).dequantize()
        elif name == head:
            state[name] = quantize_q8(tensor).dequantize()
    return dataclasses.replace(loaded, state_dict=state)


@needs_kernels
@pytest.mark.parametrize(("mode", "dtype"), [("int8", torch.int8), ("int4", torch.uint8)])
@pytest.mark.parametrize("case_name", ["tiny_llama", "tiny_qwen2"])  # untied and tied LM heads
def test_a_quantized_engine_generates_what_float32_generates_on_the_dequantized_weights(
    mode, dtype, case_name, request, make_llm
):
    case = request.getfixturevalue(case_name)
    # 45 and 70 tokens: prefill chunks above QUANT_MAX_ROWS (dequantized + MKL) as well as below.
    prompts = [[(i * 37 + s) % 500 + 3 for i in range(n)] for s, n in ((1, 20), (2, 45), (3, 7), (4, 70))]
    quantized = make_llm(case.loaded, quantization=mode)
    reference = hf_reference_model(dequantized_copy(case.loaded, mode))
    for prompt, out in zip(prompts, quantized.generate(prompts, GREEDY), strict=True):
        # The weights are the reference's exactly; what differs is x's int8 rounding in the
        # decode-sized products (engine/quantize.py).
        assert_near_reference(reference, prompt, out.outputs[0].token_ids, MAX_LOGIT_MOVE[mode])
    plain = make_llm(case.loaded)
    assert quantized.engine.core.kv_io.format.fingerprint == plain.engine.core.kv_io.format.fingerprint + "+" + mode
    model = quantized.engine.core.model
    fast, head = model.layers[0].fast["qkv"], model.lm_head_fast
    assert model.layers[0].qkv.numel() == 0 and model.lm_head.numel() == 0  # no float copy
    if GEMM is not None and GEMM.int_packs():  # only the packed copies (test_packed_int.py)
        assert fast.weight is None and fast.int_packed.fmt == ("q4" if mode == "int4" else "int8")
        assert head.weight is None and head.int_packed.fmt == "q8"
    else:
        assert fast.weight.data.dtype == dtype and model.head_blocks.fmt == "q8"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_without_the_kernels_torch_dequantizes_the_same_weights(mode, tiny_llama, make_llm, caplog):
    """The path of CUDA and bfloat16 (and of a CPU without AVX2), run here with the kernels off:
    the same quantized weights, dequantized by torch ops a slice at a time."""
    prompts = [[(i * 37 + s) % 500 + 3 for i in range(n)] for s, n in ((1, 20), (4, 70))]
    quantized = make_llm(tiny_llama.loaded, quantization=mode, cpu_kernels=False)
    assert "torch's dequantize-and-matmul" in caplog.text
    reference = make_llm(dequantized_copy(tiny_llama.loaded, mode), cpu_kernels=False)
    got = [o.outputs[0].token_ids for o in quantized.generate(prompts, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    assert quantized.engine.core.model.layers[0].fast["gate_up"].gemm is None
    bf16 = make_llm(tiny_llama.loaded, quantization=mode, dtype="bfloat16")
    plain = make_llm(tiny_llama.loaded, dtype="bfloat16")
    assert bf16.engine.core.model.layers[0].down.numel() == 0
    assert bf16.engine.core.load().weight_bytes < plain.engine.core.load().weight_bytes
    assert len(bf16.generate(prompts, GREEDY)[1].outputs[0].token_ids) == GREEDY.max_tokens


def test_bad_quantization_values_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="must be one of none, int8, int4, gguf"):
        load_config(EngineConfig, env={"KVHARBOR_QUANTIZATION": "int3"})
    assert load_config(EngineConfig, env={"KVHARBOR_QUANTIZATION": "int4"}).model.quantization == "int4"


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_product_does_not_depend_on_the_batch_it_runs_in(fmt):
    """Up to INT_ROWS rows each row is quantized and summed on its own, in one order: the same
    bits alone as in a batch (engine/quantize.py's claim; the reason decode KL does not move with load)."""
    g = torch.Generator().manual_seed(7)
    qw = FORMATS[fmt](torch.randn(40, 96, generator=g))
    x = torch.randn(INT_ROWS, 96, generator=g)
    batch = GEMM.linear_quant(x, qw)
    for rows in (1, 2, 3, 5, INT_ROWS):
        assert torch.equal(GEMM.linear_quant(x[:rows], qw), batch[:rows])
    assert all(torch.equal(GEMM.linear_quant(x[r : r + 1], qw), batch[r : r + 1]) for r in range(INT_ROWS))
