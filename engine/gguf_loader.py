"""Load a Llama-family GGUF file: architecture, dequantized weights (HF names), tokenizer fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvharbor.common.gguf_file import GGUFError, TensorInfo, read_gguf_header
from kvharbor.engine.model_arch import ModelArch

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
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class GGUFModel:
    arch: ModelArch
    state_dict: dict[str, torch.Tensor]  # float32, Hugging Face names and layouts
    metadata: dict[str, Any]  # every scalar/array field, decoded (tokenizer.* included)


def arch_from_metadata(meta: dict[str, Any]) -> ModelArch:
    name = meta.get("general.architecture")
    if name not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {name!r} is not supported (kvharbor loads llama and qwen2)")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{name}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {name}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = meta.get(f"{name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or 1
    return ModelArch(
        architecture=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{name}.attention.key_length") or hidden // heads),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # GGUF stores eps as float32 (1e-5 reads back as 9.99999974e-06): round to what was meant.
        rms_norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-6)):.7g}"),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=False,  # decided by the loader from the tensors present
        attention_bias=name == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two RoPE halves of each head's rows (for its own
    # RoPE kernel); undo it to get back to the HF "rotate_half" layout.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(data: np.memmap, info: TensorInfo) -> torch.Tensor:
    """One tensor as float32 in the HF shape, from its bytes in the mapped file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[kind]
    shape = tuple(reversed(info.dims))  # GGML lists the fastest axis first
    nbytes = int(np.prod(info.dims)) * type_size // block
    if info.offset + nbytes > len(data):
        raise GGUFError(f"tensor {info.name} runs past the end of the GGUF file: the file is truncated")
    raw = data[info.offset : info.offset + nbytes].view(np.ndarray)  # numpy views of a memmap cost per slice
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16), np.float32)
    else:  # rows of quantized blocks, as gguf.quants.dequantize reads them
        array = dequantize(raw.reshape(*shape[:-1], shape[-1] // block * type_size), kind)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


def load_gguf(path: str | Path) -> GGUFModel:
    """Dequantize every tensor to float32 under its Hugging Face name. Raises ValueError for an
    unsupported architecture or a file that is not GGUF."""
    try:
        header = read_gguf_header(path)
        data = np.memmap(path, mode="r")
    except OSError as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
    meta = header.metadata
    arch = arch_from_metadata(meta)
    state: dict[str, torch.Tensor] = {}
    for tensor in header.tensors:
        name = tensor.name
        if name == "rope_freqs.weight":
            raise ValueError(
                f"{path} scales RoPE with per-frequency factors (Llama 3.1+), which the GGUF loader does not "
                "read yet; load the model's Hugging Face folder instead"
            )
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            hf_name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        elif name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            raise ValueError(f"GGUF tensor {name!r} is not part of a {arch.architecture} decoder kvharbor knows")
        weight = _dequantize(data, tensor)
        if arch.architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = _unpermute(weight, arch.num_heads)
        elif arch.architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = _unpermute(weight, arch.num_kv_heads)
        state[hf_name] = weight
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    # The embedding's rows are the vocabulary, whatever the metadata says (or omits).
    vocab = state["model.embed_tokens.weight"].shape[0]
    arch = replace(arch, tie_word_embeddings="lm_head.weight" not in state, vocab_size=vocab)
    return GGUFModel(arch, state, meta)
