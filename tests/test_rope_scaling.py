"""RoPE scaling (Llama 3.x "llama3" and "linear"): a tiny scaled model, saved as a HF folder,
generates what transformers generates past the original context length."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from kvharbor.engine import SamplingParams
from kvharbor.engine.loader import load_model

SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_matches_transformers(kind, tmp_path, make_llm):
    from tiny_models import hf_model

    torch.manual_seed(11)
    hf = hf_model(
        "llama",
        None,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=SCALINGS[kind],
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert dict(loaded.arch.rope_scaling_dict)["rope_type"] == kind
    prompt = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()  # > 32 positions
    llm = make_llm(loaded, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)[0]


def test_longrope_takes_the_long_factors_past_the_original_context(tiny_phi3):
    """Phi-3's LongRoPE, per position: before original_max_position_embeddings the short factors
    (the reference tests cover those end to end), from it on the long ones, both times the attention
    factor, each as transformers' rotary embedding computes them for a sequence that long."""
    from kvharbor.engine.model import LlamaModel

    arch = tiny_phi3.loaded.arch
    model = LlamaModel(arch, torch.float32, torch.device("cpu"))
    original = model.rope_switch
    assert original == 512 and model.rope_scale > 1.0  # max 2048 = 4x the original: sqrt(1 + ln 4 / ln 512)
    rotary = tiny_phi3.hf.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(0, 64), torch.arange(original, original + 64)):
        # transformers picks its factors by the longest position it is asked for, so each range
        # goes on its own: the short range alone, and the long one after an original-length prefix.
        ids = torch.arange(0, int(positions[-1]) + 1)[None]
        want_cos, want_sin = rotary(x, ids)
        cos, sin = model.rope(positions, torch.float32)
        half = cos.shape[-1]
        # transformers' cos/sin are float32 of float32 angles, ours float64 rounded: ulps apart
        torch.testing.assert_close(cos[:, 0], want_cos[0, positions, :half], rtol=0, atol=1e-5)
        torch.testing.assert_close(sin[:, 0], want_sin[0, positions, :half], rtol=0, atol=1e-5)
