"""The second bundled model end to end: Gemma 3 270M (base, Q4_K_M GGUF with Q4_K, Q5_0, Q6_K and
Q8_0 blocks), loaded as shipped, against transformers' float32 Gemma 3 on the same dequantized
weights. transformers reads the architecture from the GGUF itself (its own config mapping), so a
misread window pattern, RoPE base or norm convention on our side would show."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_near_reference

from kvharbor.engine import SamplingParams
from kvharbor.engine.model.hf_reference import without_random_init
from kvharbor.engine.model.loader import load_model
from kvharbor.engine.quantize import QuantWeight

pytestmark = pytest.mark.slow  # a 268M-parameter model in float32, twice (~25 s)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,"]
STEPS = 16


@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    return load_model(str(gemma3_gguf), served_name="gemma-3-270m")


@pytest.fixture(scope="module")
def reference(gemma, gemma3_gguf):
    from transformers import AutoConfig, Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    with without_random_init():
        model = Gemma3ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(gemma.state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model


def past_the_window(tokenizer) -> list[int]:
    """600 tokens: past the 512-token window of the sliding layers."""
    return tokenizer.encode(" ".join(f"Day {i}: the fisherman counted {i * 7} fish." for i in range(60)))[:600]


def hf_greedy_of(model, prompt: list[int], ours: list[int]) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_the_file_reads_as_gemma3(gemma):
    arch = gemma.arch
    assert arch.architecture == "gemma3_text" and arch.sliding_window == 512 and arch.local_rope_theta == 10000.0
    assert [t == "full_attention" for t in arch.layer_types].count(True) == 3  # layers 6, 12, 18
    assert gemma.tokenizer.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>
    assert gemma.tokenizer.chat_template is None  # a base model: /v1/completions, not chat


def test_greedy_continuations_equal_transformers(gemma, reference, make_llm):
    llm = make_llm(gemma, max_model_len=1024, kv_cache_memory="256MiB")
    prompts = [gemma.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert prompt[0] == 2  # BOS, as transformers' Gemma tokenizer adds it
        assert out.outputs[0].token_ids == hf_greedy_of(reference, prompt, out.outputs[0].token_ids)


def test_a_prompt_past_the_window_equals_transformers(gemma, reference, make_llm):
    """600 tokens: the 15 sliding layers see their last 512, the 3 global ones everything."""
    llm = make_llm(gemma, max_model_len=1024, kv_cache_memory="256MiB", max_num_batched_tokens=256)
    prompt = past_the_window(gemma.tokenizer)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy_of(reference, prompt, out[0].outputs[0].token_ids)


def test_bfloat16_runs_and_agrees_on_the_first_tokens(gemma, make_llm):
    f32 = make_llm(gemma, max_model_len=256, kv_cache_memory="128MiB")
    bf16 = make_llm(gemma, dtype="bfloat16", max_model_len=256, kv_cache_memory="128MiB")
    prompt = [gemma.tokenizer.encode(PROMPTS[1])]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert bf16.generate(prompt, greedy)[0].outputs[0].token_ids == f32.generate(prompt, greedy)[0].outputs[0].token_ids


def test_the_file_runs_as_shipped_under_gguf_quantization(gemma, gemma3_gguf, reference, make_llm):
    """--quantization gguf keeps every block type in the file: Q4_K as q4 and Q5_0 and Q8_0 as q8
    exactly, Q6_K made q8. The rest of the difference is x's int8 rounding in decode products
    (measured here: logit moves of at most 0.05 on these prompts, one near-tie swap)."""
    kept = load_model(str(gemma3_gguf), keep_blocks=True, served_name="gemma-3-270m")
    assert all(isinstance(kept.state_dict[f"model.layers.{i}.{name}.weight"], QuantWeight)
               for i in range(18) for name in ("self_attn.q_proj", "mlp.down_proj"))  # fmt: skip
    llm = make_llm(kept, quantization="gguf", max_model_len=1024, kv_cache_memory="256MiB", max_num_batched_tokens=256)
    prompts = [gemma.tokenizer.encode(p) for p in PROMPTS] + [past_the_window(gemma.tokenizer)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_near_reference(reference, prompt, out.outputs[0].token_ids, max_move=0.6)
    model = llm.engine.core.model
    assert model.embed.numel() == 0 and model.layers[0].gate_up.numel() == 0  # no float copies kept
    # 293 MB of blocks against 1,072 MB in float32 (the q8 embedding, 168M of the 268M weights, is most)
    assert llm.engine.core.load().weight_bytes < gemma_float_bytes(gemma) / 3


def gemma_float_bytes(loaded) -> int:
    return sum(t.numel() * 4 for t in loaded.state_dict.values())
