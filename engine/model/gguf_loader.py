"""Load a Llama-family (or Gemma 2/3) GGUF file: architecture, weights (HF names; dequantized, or
with their Q4_0 / Q4_1 / Q8_0 blocks kept for `--quantization gguf`), tokenizer fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvharbor.common.gguf_file import GGUFError, TensorInfo, read_gguf_header
from kvharbor.common.tokenizer import gguf_eos_ids
from kvharbor.engine.model import gguf_blocks
from kvharbor.engine.model.arch import GEMMA3_LOCAL_ROPE_THETA, ModelArch, gemma_layer_types
from kvharbor.engine.quantize import QuantWeight

# GGUF tensor name -> Hugging Face name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms a layer (llama.cpp's names differ from the Llama ones above for ffn_norm).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")  # general.architecture, llama.cpp's spelling
_HF_NAMES = {"gemma3": "gemma3_text"}  # where transformers' model_type differs
# What llama.cpp hard-codes for Gemma and the files do not carry: the window pattern, Gemma 3's
# sliding layers' RoPE base, and the 27B models' attention scale (hidden / heads, not head_dim),
# told apart by depth.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass
class GGUFModel:
    arch: ModelArch
    state_dict: dict[str, torch.Tensor | QuantWeight]  # Hugging Face names and layouts; float32 unless kept
    metadata: dict[str, Any]  # every scalar/array field, decoded (tokenizer.* included)


def arch_from_metadata(meta: dict[str, Any]) -> ModelArch:
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported (kvharbor loads {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{name}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {name}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    head_dim = int(meta.get(f"{name}.attention.key_length") or hidden // heads)
    vocab = meta.get(f"{name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or 1
    return ModelArch(
        architecture=_HF_NAMES.get(name, name),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # GGUF stores eps as float32 (1e-5 reads back as 9.99999974e-06): round to what was meant.
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-6)):.7g}"),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=False,  # decided by the loader from the tensors present
        attention_bias=name == "qwen2",
        qk_norm=name in ("qwen3", "gemma3"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_eos_ids(meta),
        rope_scaling=_rope_scaling(meta, name),
        **(_gemma_fields(meta, name, layers, hidden // heads, head_dim) if name in _GEMMA_27B_LAYERS else {}),
    )


def _rope_scaling(meta: dict[str, Any], name: str) -> tuple[tuple[str, Any], ...] | None:
    """RoPE scaling where the file gives it: linear (Gemma 3 4B and up: factor 8) or yarn (Qwen2.5's
    long context, with its original context); None otherwise. Llama 3's per-frequency factors
    come as a tensor instead (_with_freq_factors)."""
    kind, factor = meta.get(f"{name}.rope.scaling.type"), meta.get(f"{name}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return (("factor", float(factor)), ("rope_type", "linear"))
    original = meta.get(f"{name}.rope.scaling.original_context_length")
    if kind == "yarn" and original:
        return (("factor", float(factor)), ("original_max_position_embeddings", int(original)), ("rope_type", "yarn"))
    raise ValueError(
        f"GGUF rope scaling {kind!r} is not supported (linear, and yarn with its original context length, are); "
        "load the Hugging Face folder"
    )


def _with_freq_factors(arch: ModelArch, factors: torch.Tensor, path: str | Path) -> ModelArch:
    """llama.cpp writes Llama 3.1+'s RoPE scaling as rope_freqs.weight: one divisor per frequency
    (1 for the fast ones, the factor for the slow ones, a blend between), which it divides each
    inverse frequency by. Kept as the `freq_factors` scaling (engine/model/decoder.py)."""
    if arch.rope_scaling is not None:
        raise ValueError(f"{path} gives both rope_freqs.weight and a {arch.rope_scaling_dict} RoPE scaling")
    if factors.numel() != arch.head_dim // 2:
        need = arch.head_dim // 2
        raise ValueError(f"{path}: rope_freqs.weight has {factors.numel()} factors, the heads need {need}")
    return replace(arch, rope_scaling=(("factors", tuple(factors.tolist())), ("rope_type", "freq_factors")))


def _gemma_fields(meta: dict[str, Any], name: str, layers: int, per_head: int, head_dim: int) -> dict[str, Any]:
    """Gemma's ModelArch fields from a GGUF: windows in llama.cpp's fixed pattern (every 2nd layer
    global in Gemma 2, every 6th in Gemma 3), soft-caps (Gemma 2), the local RoPE base (Gemma 3),
    the attention scale (hidden / heads in the 27B models, head_dim in the others)."""
    window = meta.get(f"{name}.attention.sliding_window")
    soft = {key: float(v) for key in ("attn_logit_softcapping", "final_logit_softcapping")
            if (v := meta.get(f"{name}.{key}"))}  # fmt: skip
    return dict(
        sliding_window=int(window) if window else None,
        layer_types=gemma_layer_types(_HF_NAMES.get(name, name), layers) if window else None,
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA if name == "gemma3" else None,
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        norm_plus_one=True,
        embed_scale=True,
        query_pre_attn_scalar=float(per_head if layers == _GEMMA_27B_LAYERS[name] else head_dim),
        attn_softcap=soft.get("attn_logit_softcapping"),
        final_softcap=soft.get("final_logit_softcapping"),
    )


def _unpermute(w: torch.Tensor | QuantWeight, n_heads: int) -> torch.Tensor | QuantWeight:
    # llama.cpp's converter interleaves the two RoPE halves of each head's rows (for its own
    # RoPE kernel); undo it to get back to the HF "rotate_half" layout. Blocks lie along the
    # rows, so kept blocks move with their rows.
    if isinstance(w, QuantWeight):
        return w.rows(_unpermute(torch.arange(w.n), n_heads))
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _raw(data: np.memmap, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes in the mapped file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    nbytes = int(np.prod(info.dims)) * type_size // block
    if info.offset + nbytes > len(data):
        raise GGUFError(f"tensor {info.name} runs past the end of the GGUF file: the file is truncated")
    return data[info.offset : info.offset + nbytes].view(np.ndarray)  # numpy views of a memmap cost per slice


def _dequantize(data: np.memmap, info: TensorInfo) -> torch.Tensor:
    """One tensor as float32 in the HF shape, from its bytes in the mapped file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(info.dims))  # GGML lists the fastest axis first
    raw = _raw(data, info)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16), np.float32)
    else:  # rows of quantized blocks, as gguf.quants.dequantize reads them
        array = dequantize(raw.reshape(*shape[:-1], shape[-1] // block * type_size), kind)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def _blocks(data: np.memmap, info: TensorInfo) -> QuantWeight:
    """A 2-D tensor's blocks repacked for the kernels (engine/model/gguf_blocks.py), never dequantized."""
    if info.ggml_type not in gguf_blocks.BLOCK_BYTES:
        from gguf import GGMLQuantizationType

        raise ValueError(
            f"--quantization gguf keeps {', '.join(gguf_blocks.NAMES.values())} blocks, and tensor {info.name} is "
            f"{GGMLQuantizationType(info.ggml_type).name}: use --quantization none (dequantized at load), int8 or int4"
        )
    k, n = info.dims
    return gguf_blocks.repack(_raw(data, info).reshape(n, -1), info.ggml_type, k)


def _kept(name: str, info: TensorInfo) -> bool:
    """Whether --quantization gguf keeps this tensor's blocks: every projection; the embedding
    and the LM head when the file quantizes them (float ones stay float)."""
    if name in ("token_embd.weight", "output.weight"):
        return info.ggml_type in gguf_blocks.BLOCK_BYTES
    return name.endswith(".weight") and not name.endswith("norm.weight")


def load_gguf(path: str | Path, keep_blocks: bool = False) -> GGUFModel:
    """Every tensor under its Hugging Face name: dequantized to float32, or, with `keep_blocks`,
    the projections (and a quantized embedding / LM head) as kernel-format QuantWeights of the
    file's own blocks. Raises ValueError for an unsupported architecture, a file that is not
    GGUF, or (keep_blocks) a projection in a block type the kernels do not take."""
    try:
        header = read_gguf_header(path)
        data = np.memmap(path, mode="r")
    except OSError as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
    meta = header.metadata
    arch = arch_from_metadata(meta)
    state: dict[str, torch.Tensor] = {}
    layer_names = _GEMMA_LAYER_NAMES if arch.sandwich_norms else _LAYER_NAMES
    for tensor in header.tensors:
        name = tensor.name
        if name == "rope_freqs.weight":
            arch = _with_freq_factors(arch, _dequantize(data, tensor), path)
            continue
        m = _LAYER_RE.match(name)
        if m and m.group(2) in layer_names:
            hf_name = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
        elif name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            raise ValueError(f"GGUF tensor {name!r} is not part of a {arch.architecture} decoder kvharbor knows")
        weight = _blocks(data, tensor) if keep_blocks and _kept(name, tensor) else _dequantize(data, tensor)
        if arch.architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = _unpermute(weight, arch.num_heads)
        elif arch.architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = _unpermute(weight, arch.num_kv_heads)
        elif arch.norm_plus_one and name.endswith("norm.weight"):  # llama.cpp stores these norms as 1 + w; HF as w
            weight = weight - 1.0
        state[hf_name] = weight
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    # The embedding's rows are the vocabulary, whatever the metadata says (or omits).
    embed = state["model.embed_tokens.weight"]
    vocab = embed.n if isinstance(embed, QuantWeight) else embed.shape[0]
    arch = replace(arch, tie_word_embeddings="lm_head.weight" not in state, vocab_size=vocab)
    return GGUFModel(arch, state, meta)
