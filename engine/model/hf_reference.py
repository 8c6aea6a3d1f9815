"""The independent reference: a Hugging Face transformers model holding the same weights.

Tests compare logits and tokens with it; benchmarks time it as the baseline. transformers is a
test/bench dependency only, so it is imported here lazily and nothing in the engine imports this.
"""

from __future__ import annotations

import contextlib

import torch

from kvharbor.engine.model.loader import LoadedModel


def hf_reference_model(loaded: LoadedModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A LlamaForCausalLM / Qwen2ForCausalLM with `loaded`'s architecture and weights, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    a = loaded.arch
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if a.architecture == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling_dict,
        rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        bos_token_id=a.bos_token_id,
        eos_token_id=list(a.eos_token_ids) or None,
        pad_token_id=a.eos_token_ids[0] if a.eos_token_ids else None,
    )
    with without_random_init():
        model = model_cls(config)
    state = dict(loaded.state_dict)
    if a.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def without_random_init() -> contextlib.AbstractContextManager:
    """transformers' own switch that skips drawing random weights: the caller loads every one
    after, so drawing them only costs time (2.7 s for Gemma 3 270M here). Buffers computed at
    construction (RoPE's inverse frequencies) are still computed."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()
