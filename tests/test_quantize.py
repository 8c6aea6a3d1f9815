"""--quantization int8: per-channel symmetric weights, the AVX2 int8 kernel against a float64
product of the dequantized weights, and an engine that computes what float32 computes on those
dequantized weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvharbor.common.config import ConfigError, load_config
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.config import EngineConfig
from kvharbor.engine.cpu_kernels import load
from kvharbor.engine.quantize import dequantize_int8, quantize_int8

GEMM = load(2)
needs_kernels = pytest.mark.skipif(GEMM is None, reason="no AVX2+FMA kernels on this machine")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def test_each_weight_is_within_half_a_step_and_zero_rows_survive():
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different ranges
    w[7] = 0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and int(q.abs().max()) <= 127
    assert torch.all((dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q[7] == 0) and scale[7] == 1.0
    assert torch.equal(q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0], torch.full((39,), 127, dtype=torch.int8))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64])
@pytest.mark.parametrize(("n", "k"), [(24, 576), (19, 100), (3072, 64)])
def test_the_int8_kernel_equals_a_float64_product_of_the_dequantized_weight(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    q, scale = quantize_int8(w)
    want = x.double() @ dequantize_int8(q, scale).double().T + bias.double()
    got = GEMM.linear_q8(x, q, scale, bias)
    # float32 sums of k products (the kernel: 8 lanes, then a tree): error <= ~k * 2^-24 * sum|x*w|.
    bound = k * 2.0**-24 * (x.double().abs() @ dequantize_int8(q, scale).double().abs().T) + 1e-6
    assert torch.all((got.double() - want).abs() <= bound)
    strided = torch.randn(rows, 2 * k, generator=g)[:, :k]  # rows of a wider tensor, as attention hands them
    assert torch.allclose(GEMM.linear_q8(strided, q, scale), strided @ dequantize_int8(q, scale).T, atol=1e-4)


@needs_kernels
def test_the_kernel_refuses_what_it_does_not_take():
    q, scale = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="int8"):
        GEMM.linear_q8(torch.randn(2, 16), q.to(torch.int16), scale)
    with pytest.raises(ValueError, match="float32"):
        GEMM.linear_q8(torch.randn(2, 16, dtype=torch.float64), q, scale)


def dequantized_copy(loaded):
    """The same model with every projection replaced by its int8 round trip, in float32."""
    state = dict(loaded.state_dict)
    for name, tensor in state.items():
        if any(name.endswith(p + ".weight") for p in PROJECTIONS):
            state[name] = dequantize_int8(*quantize_int8(tensor))
    return dataclasses.replace(loaded, state_dict=state)


@needs_kernels
def test_an_int8_engine_generates_what_float32_generates_on_the_dequantized_weights(tiny_llama, make_llm):
    prompts = [[(i * 37 + s) % 500 + 3 for i in range(n)] for s, n in ((1, 20), (2, 45), (3, 7))]
    int8 = make_llm(tiny_llama.loaded, quantization="int8")
    reference = make_llm(dequantized_copy(tiny_llama.loaded), cpu_kernels=False)
    got = [o.outputs[0].token_ids for o in int8.generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]
    assert got == want
    plain = make_llm(tiny_llama.loaded)
    assert int8.engine.kv_io.format.fingerprint == plain.engine.kv_io.format.fingerprint + "+int8"
    layer = int8.engine.model.layers[0]
    assert layer.qkv.numel() == 0 and layer.fast["qkv"].q.dtype == torch.int8  # no float copy kept


def test_bad_quantization_values_and_combinations_are_refused(tiny_llama):
    with pytest.raises(ConfigError, match="must be one of none, int8"):
        load_config(EngineConfig, env={"KVHARBOR_QUANTIZATION": "int3"})
    assert load_config(EngineConfig, env={"KVHARBOR_QUANTIZATION": "int8"}).model.quantization == "int8"
    with pytest.raises(ValueError, match="float32"):
        LLM(loaded_model=tiny_llama.loaded, quantization="int8", dtype="bfloat16", num_kv_blocks=8)
    with pytest.raises(ValueError, match="--no-cpu-kernels"):
        LLM(loaded_model=tiny_llama.loaded, quantization="int8", dtype="float32", cpu_kernels=False, num_kv_blocks=8)
