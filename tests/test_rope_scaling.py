"""RoPE scaling (Llama 3.x "llama3", "linear", and Qwen2.5's "yarn"): a tiny scaled model, saved as a HF folder,
generates what transformers generates past the original context length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from kvharbor.engine import SamplingParams
from kvharbor.engine.model.loader import load_model

SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    # the cos/sin scale (0.1 ln 4 + 1) and the ramp both show in the logits
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-deepseek": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "truncate": False,
    },
}


def scaled_llama(kind: str):
    from tiny_models import hf_model

    torch.manual_seed(11)
    return hf_model(
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


PROMPT = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()  # > 32 positions


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_matches_transformers(kind, tmp_path, make_llm):
    hf = scaled_llama(kind)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert dict(loaded.arch.rope_scaling_dict)["rope_type"] == kind.split("-")[0]
    llm = make_llm(loaded, max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 12)[0]


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_gguf_rope_scaling_matches_transformers(kind, tmp_path, make_llm):
    """As llama.cpp writes them: Llama 3's scaling as rope_freqs.weight (each frequency's divisor:
    here transformers' own unscaled over scaled frequencies), yarn as rope.scaling.* metadata."""
    from types import SimpleNamespace

    from test_gguf import write_gguf

    hf = scaled_llama(kind)
    hf.save_pretrained(tmp_path / "hf")
    case = SimpleNamespace(loaded=load_model(str(tmp_path / "hf")))
    path = tmp_path / f"{kind}.gguf"
    if kind == "llama3":
        plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        write_gguf(case, path, rope_freqs=plain / hf.model.rotary_emb.inv_freq)
    else:
        write_gguf(case, path, rope={"type": "yarn", "factor": 4.0, "original_context_length": 32})
    loaded = load_model(str(path))
    assert loaded.arch.rope_scaling_dict["rope_type"] == {"llama3": "freq_factors", "yarn": "yarn"}[kind]
    out = make_llm(loaded, max_model_len=256).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                                                 ignore_eos=True))  # fmt: skip
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 12)[0]


def test_gguf_rope_scaling_it_cannot_honour_is_refused(tiny_llama, tmp_path):
    from test_gguf import write_gguf

    write_gguf(tiny_llama, tmp_path / "longrope.gguf", rope={"type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="rope scaling 'longrope' is not supported"):
        load_model(str(tmp_path / "longrope.gguf"))
    write_gguf(tiny_llama, tmp_path / "short.gguf", rope_freqs=np.ones(3))
    with pytest.raises(ValueError, match=r"rope_freqs\.weight has 3 factors, the heads need 8"):
        load_model(str(tmp_path / "short.gguf"))


def test_longrope_takes_the_long_factors_past_the_original_context(tiny_phi3):
    """Phi-3's LongRoPE, per position: before original_max_position_embeddings the short factors
    (the reference tests cover those end to end), from it on the long ones, both times the attention
    factor, each as transformers' rotary embedding computes them for a sequence that long."""
    from kvharbor.engine.model.decoder import LlamaModel

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


def test_yarn_serves_the_original_context_times_its_factor():
    """Qwen2.5's yarn configs keep max_position_embeddings at the original 32,768 with factor 4: the
    engine serves 131,072 tokens, as vLLM does, not the unscaled length."""
    from dataclasses import replace

    from kvharbor.engine.model.arch import ModelArch

    base = ModelArch.from_hf_config(scaled_llama("linear").config.to_dict())
    yarn = (("factor", 4.0), ("original_max_position_embeddings", 32768), ("rope_type", "yarn"))
    qwen = replace(base, max_position_embeddings=32768, rope_scaling=yarn)
    assert qwen.context_limit == 131072
    assert replace(base, max_position_embeddings=32768).context_limit == 32768  # no yarn: the config's own
