"""The GGUF loader: weights equal transformers' own GGUF import for SmolLM2, and GGUF files
written here (llama with llama.cpp's Q/K permutation, qwen2 with qkv bias, quantized and not)
load back to the Hugging Face weights and generate the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from kvharbor.common.model_files import default_model_path
from kvharbor.engine import SamplingParams
from kvharbor.engine.model.loader import load_model


@pytest.fixture(scope="module")
def bundled_reader():
    """llama.cpp's gguf-py reader over the bundled file, parsed once (~5 s here) for two tests."""
    from gguf import GGUFReader

    return GGUFReader(str(default_model_path()))


@pytest.mark.slow  # ~8 s here: llama.cpp's own reader and dequantizer over the whole file
def test_smollm2_weights_equal_the_gguf_packages_own_dequantization(smollm, bundled_reader):
    """Every tensor of the bundled Q4_1 file, as llama.cpp's gguf-py reads and dequantizes it
    (what transformers' GGUF import does inside, at a quarter of its 30 s here), renamed and
    un-permuted by this file's own table (which the HF round trips below check)."""
    from gguf import dequantize

    a = smollm.arch
    ours = smollm.state_dict
    seen = set()
    for t in bundled_reader.tensors:
        name, heads = _hf_name(t.name, a.num_heads, a.num_kv_heads)
        ref = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(ours[name].shape))
        if heads:
            ref = _unpermute(ref, heads)
        assert torch.equal(ours[name], torch.from_numpy(np.ascontiguousarray(ref))), name
        seen.add(name)
    assert seen == set(ours)  # the file has no output.weight: tied to the embeddings, as ours


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q/k rows of llama models.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, heads: int, kv_heads: int) -> tuple[str, int]:
    """The HF name of a llama GGUF tensor, and the head count its rows were permuted by (0: none)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name], 0
    _, layer, part, kind = gguf_name.split(".")
    hf = next(h for h, g in _NAMES.items() if g == part)
    permuted = {"attn_q": heads, "attn_k": kv_heads}.get(part, 0) if kind == "weight" else 0
    return f"model.layers.{layer}.{hf}.{kind}", permuted


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def write_gguf(case, path, quant: str | None = None, rope: dict | None = None, rope_freqs=None) -> None:
    """`case`'s model as llama.cpp would write it: `rope` is a rope.scaling.* metadata dict and
    `rope_freqs` Llama 3's per-frequency divisors (the rope_freqs.weight tensor)."""
    import gguf

    a = case.loaded.arch
    name = a.architecture
    w = gguf.GGUFWriter(str(path), name)
    w.add_key_length(a.head_dim)  # qwen3's head_dim is not hidden / heads
    w.add_value_length(a.head_dim)
    w.add_block_count(a.num_layers)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_heads)
    w.add_head_count_kv(a.num_kv_heads)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_eos_token_id(2)
    for key, value in (rope or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
            f"{name}.rope.scaling.{key}", value
        )
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    for hf_name, tensor in case.loaded.state_dict.items():
        arr = tensor.numpy().astype(np.float32)
        if hf_name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            out = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            out = "output.weight"
        else:
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{_NAMES[module]}.{kind}"
            if name == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                arr = _permute(arr, a.num_heads if "q_proj" in module else a.num_kv_heads)
        if qtype is not None and arr.ndim == 2:
            w.add_tensor(out, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case_name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_a_written_gguf_loads_back_exactly_and_generates_the_same(case_name, request, tmp_path, make_llm):
    case = request.getfixturevalue(case_name)
    path = tmp_path / f"{case.name}.gguf"
    write_gguf(case, path)
    loaded = load_model(str(path))
    assert loaded.name == case.name and loaded.tokenizer is None
    assert loaded.arch.attention_bias == (case_name == "tiny_qwen2")
    assert loaded.arch.tie_word_embeddings == case.loaded.arch.tie_word_embeddings
    for name, tensor in case.loaded.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    prompt = case.prompts[3]
    out = make_llm(loaded).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(case.hf, prompt, 8)[0]


def test_quantized_tensors_dequantize_close_to_the_originals(tiny_llama, tmp_path):
    path = tmp_path / "q8.gguf"
    write_gguf(tiny_llama, path, quant="Q8_0")
    loaded = load_model(str(path))
    for name, tensor in tiny_llama.loaded.state_dict.items():
        got = loaded.state_dict[name]
        assert got.shape == tensor.shape
        # Q8_0: one scale per 32 values, 8-bit codes: error below 1/127 of each block's max.
        assert (got - tensor).abs().max() <= tensor.abs().max() / 100, name


def test_not_a_gguf_file_is_refused_clearly(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(bogus))


def _reference_header(path, reader=None) -> tuple[dict, list[tuple]]:
    """What the gguf package's own (slow) reader says of the same file."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(str(path))
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), t.data_offset) for t in reader.tensors]
    return meta, tensors


def _written_gguf(path, alignment: int = 32):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_int32("t.i32", -(2**31))
    writer.add_uint64("t.u64", 2**63 + 1)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 5), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_fast_header_reader_says_what_the_gguf_package_says(tmp_path, alignment, bundled_reader):
    from kvharbor.common.gguf_file import read_gguf_header

    # The bundled file once (its gguf-package parse takes ~6 s here), written files at each alignment.
    paths = [_written_gguf(tmp_path / f"t{alignment}.gguf", alignment)] + ([default_model_path()] * (alignment == 32))
    for path in paths:
        header = read_gguf_header(path)
        meta, tensors = _reference_header(path, bundled_reader if path == default_model_path() else None)
        assert header.metadata == meta
        assert [(t.name, t.dims, t.ggml_type, t.offset) for t in header.tensors] == tensors
    if alignment == 32:
        assert header.metadata["tokenizer.ggml.tokens"][:3] == meta["tokenizer.ggml.tokens"][:3]


def test_broken_gguf_headers_are_refused_with_the_reason(tmp_path):
    from kvharbor.common.gguf_file import GGUFError, read_gguf_header

    good = _written_gguf(tmp_path / "good.gguf").read_bytes()
    cases = {
        "magic": (b"GGML" + good[4:], "it does not start with 'GGUF'"),
        "version": (good[:4] + (9).to_bytes(4, "little") + good[8:], "it is version 9"),
        "truncated": (good[:200], "it ends inside its header"),
        "empty": (b"", "it does not start with 'GGUF'"),
    }
    for name, (data, reason) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFError, match=f"is not a readable GGUF file: {reason}"):
            read_gguf_header(path)
