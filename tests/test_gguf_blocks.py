"""--quantization gguf: Q4_0, Q4_1 and Q8_0 blocks repacked for the kernels give exactly what the
gguf package's own dequantization gives, and an engine on a GGUF file's blocks generates what the
same file dequantized to float32 generates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_near_reference
from test_gguf import write_gguf
from test_quantize import MAX_LOGIT_MOVE, kernel_bound

from kvharbor.engine import SamplingParams
from kvharbor.engine.cpu.cpu_kernels import load
from kvharbor.engine.gguf_blocks import repack
from kvharbor.engine.hf_reference import hf_reference_model
from kvharbor.engine.loader import load_model
from kvharbor.engine.quantize import QuantLinear, QuantWeight

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
        assert torch.all((got - x.double() @ dense.T).abs() <= kernel_bound(x, dense))


def test_a_block_type_the_kernels_do_not_take_is_refused():
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0"):
        repack(np.zeros((2, 40), np.uint8), 12, 64)  # Q4_K
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        repack(np.zeros((2, 20), np.uint8), 3, 40)


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
    model = blocks.engine.model
    assert model.embed.numel() == 0 and model.layers[0].gate_up.numel() == 0  # no float copies kept
    assert blocks.engine.kv_io.format.fingerprint.endswith("+gguf")
    # /load's memory ledger: the blocks (4.5-8.5 bits a weight) against float32's 32 bits.
    assert blocks.engine.load().weight_bytes < dense.engine.load().weight_bytes / 3


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
