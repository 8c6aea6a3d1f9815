"""Random-weight Hugging Face models for tests (no hub: built from transformers configs), written
once: the tiny Llama and Qwen2 references (conftest.py), the tiny chat model behind test servers
(servers.py), and the one-off shapes single tests need."""

from __future__ import annotations

import torch

# The tiny references' shape. Wide weights (initializer_range 0.25) make logits peaked, so greedy
# argmax is not decided by float noise.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.25,
)


def hf_model(kind: str = "llama", seed: int | None = None, **config) -> torch.nn.Module:
    """A float32 transformers Llama (`kind` llama), Mistral (mistral), Qwen2 (qwen2, qkv bias),
    Qwen3 (qwen3, q/k norm), Phi-3 (phi3, fused projections, LongRoPE), Gemma 2 (gemma2) or Gemma 3
    (gemma3) in eval mode, with random weights from `seed` (None: torch's current generator) and
    exactly `config`."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if seed is not None:
        torch.manual_seed(seed)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[kind]
    model = model_cls(config_cls(**config)).float().eval()
    if kind.startswith("gemma"):  # Gemma's norms start at 0 (a weight of 1 + w): make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    return model


def longrope(head_dim: int, original: int, seed: int = 3) -> dict:
    """A Phi-3 LongRoPE rope dict with random factors (short near 1, long 1-8), as Phi-3 ships."""
    gen = torch.Generator().manual_seed(seed)
    half = head_dim // 2
    short = (1 + 0.1 * torch.rand(half, generator=gen)).tolist()
    long = (1 + 7 * torch.rand(half, generator=gen)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original, "rope_theta": 10000.0}  # fmt: skip


def tiny_embedding_model(path, pooling: str = "last", tokenizer=None):
    """A random-weight Qwen3 embedding model as Qwen3-Embedding ships: a bare Qwen3Model (no LM
    head, no "model." prefix) with sentence-transformers' pooling and Normalize modules, and
    `tokenizer`'s files when given (a kvharbor Tokenizer: its vocabulary sizes the model).
    Returns the transformers model, the reference."""
    import json

    from transformers import Qwen3Config, Qwen3Model

    vocab_size = tokenizer.vocab_size if tokenizer is not None else TINY["vocab_size"]
    shape = {**TINY, "vocab_size": vocab_size, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}
    torch.manual_seed(1122)
    model = Qwen3Model(Qwen3Config(**shape, rope_theta=1e6, tie_word_embeddings=True)).eval()
    model.save_pretrained(path)
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_lasttoken": pooling == "last", "pooling_mode_mean_tokens": pooling == "mean"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": shape["hidden_size"],
                                                                **modes}))  # fmt: skip
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    if tokenizer is not None:
        tokenizer.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": None, "add_bos_token": False}))
    return model
