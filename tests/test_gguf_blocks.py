"""--quantization gguf: Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K blocks repacked for the kernels give exactly
what the gguf package's own dequantization gives (Q5_K and Q6_K within half a q8 step of it), and
an engine on a GGUF file's blocks generates what the same file dequantized to float32 generates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_near_reference
from test_gguf import write_gguf
from test_quantize import MAX_LOGIT_MOVE, kernel_bound

from kvharbor.engine import SamplingParams
from kvharbor.engine.cpu.cpu_kernels import load
from kvharbor.engine.model.gguf_blocks import BLOCK_BYTES, repack
from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.model.loader import load_model
from kvharbor.engine.quantize import QuantLinear, QuantWeight, concat, quantize_int4, quantize_q8

GEMM = load(2)
needs_kernels = pytest.mark.skipif(GEMM is None, reason="no AVX2+FMA kernels on this machine")
KINDS = ("Q4_0", "Q4_1", "Q8_0")


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_hold_exactly_what_gguf_dequantizes(kind):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(3).standard_normal((12, 96)).astype(np.float32) * 3
    w[4, :32] = 0  # an all-zero block
    raw = gguf.quants.quantize(w, qtype)
    qw = repack(raw, int(qtype), 96)
    assert qw.fmt == ("q8" if kind == "Q8_0" else "q4") and (qw.n, qw.k) == (12, 96)
    assert np.array_equal(qw.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_multiply_like_their_dequantized_values(kind):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    g = np.random.default_rng(5)
    raw = gguf.quants.quantize(g.standard_normal((40, 64)).astype(np.float32), qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    qw = repack(raw, int(qtype), 64)
    for rows in (1, 2, 3, 8, 50):
        x = torch.from_numpy(g.standard_normal((rows, 64)).astype(np.float32))
        got = QuantLinear(GEMM, qw, max_rows=32)(x, None).double()
        assert torch.all((got - x.double() @ dense.T).abs() <= kernel_bound(x, dense, GEMM.int_packs()))


# Blocks gguf cannot write (it has no K-quant quantizer): random bytes, which reach every packing
# of the 6-bit scales and high bits, with sane f16 scales so the values are finite.
SUPER_KINDS = {"Q5_0": 6, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SCALE_BYTES = {6: [(0, 2)], 12: [(0, 2), (2, 4)], 13: [(0, 2), (2, 4)], 14: [(208, 210)]}


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    per_block = 32 if ggml_type == 6 else 256
    raw = g.integers(0, 256, (n, k // per_block, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    for first, last in SCALE_BYTES[ggml_type]:
        raw[..., first:last] = np.asarray(g.uniform(0.001, 0.02, raw.shape[:2]), np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", SUPER_KINDS)
def test_k_quant_and_q5_blocks_hold_what_gguf_dequantizes(kind):
    import gguf

    qtype = SUPER_KINDS[kind]
    raw = random_blocks(qtype, 6, 512)
    want = gguf.quants.dequantize(raw, qtype)
    qw = repack(raw, qtype, 512)
    got = qw.dequantize().numpy()
    assert qw.fmt == ("q4" if kind == "Q4_K" else "q8") and (qw.n, qw.k) == (6, 512)
    if kind in ("Q4_K", "Q5_0"):  # kept exactly
        assert np.array_equal(got, want)
    else:  # made q8: each weight within half a step of its 32-group's max / 127
        half_step = np.abs(want).reshape(6, -1, 32).max(-1, keepdims=True) / 254 * (1 + 1e-5)  # and float32 rounding
        assert np.all(np.abs(got - want).reshape(6, -1, 32) <= half_step) and not np.array_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("kind", SUPER_KINDS)
def test_k_quant_blocks_multiply_like_their_dequantized_values(kind):
    qw = repack(random_blocks(SUPER_KINDS[kind], 20, 256, seed=1), SUPER_KINDS[kind], 256)
    dense = qw.dequantize().double()
    g = torch.Generator().manual_seed(2)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=g)
        got = QuantLinear(GEMM, qw, max_rows=32)(x, None).double()
        assert torch.all((got - x.double() @ dense.T).abs() <= kernel_bound(x, dense))


def test_fused_parts_of_different_formats_become_q8():
    """llama.cpp's _M mixes give a layer's v (or some down) projections a finer type than q and k."""
    w = torch.randn(3, 8, 64)
    parts = [quantize_int4(w[0]), quantize_int4(w[1]), quantize_q8(w[2])]
    fused = concat(parts)
    assert fused.fmt == "q8" and (fused.n, fused.k) == (24, 64)
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fused.dequantize()[16:], want[16:])  # the q8 part unchanged
    assert torch.allclose(fused.dequantize(), want, atol=want.abs().max().item() / 254 * 1.01, rtol=0)
    with pytest.raises(ValueError, match="one width"):
        concat([quantize_q8(w[0]), quantize_q8(torch.randn(8, 32))])


def test_a_block_type_the_kernels_do_not_take_is_refused():
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K"):
        repack(np.zeros((2, 84), np.uint8), 10, 256)  # Q2_K
    with pytest.raises(ValueError, match="whole 32-element Q4_1 blocks"):
        repack(np.zeros((2, 20), np.uint8), 3, 40)
    with pytest.raises(ValueError, match="whole 256-element Q4_K blocks"):
        repack(np.zeros((2, 144), np.uint8), 12, 288)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case_name", ["tiny_llama", "tiny_qwen2"])
def test_an_engine_on_the_blocks_generates_what_the_dequantized_file_generates(
    kind, case_name, request, tmp_path, make_llm
):
    case = request.getfixturevalue(case_name)
    path = tmp_path / f"{case.name}.{kind}.gguf"
    write_gguf(case, path, quant=kind)  # every 2-D tensor, the embedding and LM head too
    kept = load_model(str(path), keep_blocks=True)
    assert isinstance(kept.state_dict["model.layers.0.self_attn.q_proj.weight"], QuantWeight)
    assert isinstance(kept.state_dict["model.embed_tokens.weight"], QuantWeight)
    assert kept.state_dict["model.norm.weight"].dtype == torch.float32
    blocks = make_llm(kept, quantization="gguf")
    dense_weights = load_model(str(path))
    dense = make_llm(dense_weights)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = case.prompts[:2] + case.prompts[-1:]  # 5, 16 and 100 tokens: kernel and MKL rows
    reference = hf_reference_model(dense_weights)
    for prompt, out in zip(prompts, blocks.generate(prompts, params), strict=True):
        # The same weights; x's int8 rounding in decode-sized products is the difference.
        assert_near_reference(reference, prompt, out.outputs[0].token_ids, MAX_LOGIT_MOVE[kind])
    model = blocks.engine.core.model
    assert model.embed.numel() == 0 and model.layers[0].gate_up.numel() == 0  # no float copies kept
    assert blocks.engine.core.kv_io.format.fingerprint.endswith("+gguf")
    # /load's memory ledger: the blocks (4.5-8.5 bits a weight) against float32's 32 bits.
    assert blocks.engine.core.load().weight_bytes < dense.engine.core.load().weight_bytes / 3


def test_gguf_mode_needs_a_gguf_file_of_kept_block_types(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"pass a \.gguf file"):
        load_model(str(tiny_llama.loaded.path), keep_blocks=True)
    path = tmp_path / "f32.gguf"
    write_gguf(tiny_llama, path)  # float32 tensors
    with pytest.raises(ValueError, match="is F32: use --quantization none"):
        load_model(str(path), keep_blocks=True)
    from kvharbor.engine import LLM

    with pytest.raises(ValueError, match="needs the model's GGUF blocks"):
        LLM(loaded_model=tiny_llama.loaded, quantization="gguf", dtype="float32", num_kv_blocks=8)


@needs_kernels
def test_kept_blocks_run_only_under_gguf(tiny_llama, tmp_path):
    from kvharbor.engine import LLM

    path = tmp_path / "q4.gguf"
    write_gguf(tiny_llama, path, quant="Q4_1")
    kept = load_model(str(path), keep_blocks=True)
    for mode in ("none", "int8"):
        with pytest.raises(ValueError, match="only --quantization gguf runs"):
            LLM(loaded_model=kept, quantization=mode, dtype="float32", num_kv_blocks=8)


@needs_kernels
def test_an_empty_batch_is_an_empty_product():
    qw = repack(np.zeros((4, 20), np.uint8), 3, 32)
    assert GEMM.linear_quant(torch.empty(0, 32), qw).shape == (0, 4)
