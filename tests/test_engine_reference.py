"""The engine against Hugging Face transformers (float32) on the same weights: logits of the
prompt and of 8 decode steps, and greedy 32-token outputs in five scheduling situations. The
reference is teacher-forced (conftest.hf_next_tokens): one HF forward over the prompt and our
tokens, whose argmax at every position must be our next token.

Models: SmolLM2-135M from the bundled GGUF, and random-weight tiny Llama and Qwen2 (qkv bias,
tied embeddings) built from transformers configs and loaded from their saved HF folders.

Logit tolerance: both sides compute in float32 (24-bit mantissa, ~6e-8 relative), but in a
different order: fused QKV and gate/up matmuls, SDPA instead of eager attention, fused RMSNorm,
paged gathers. Measured: ~1.5e-5 on SmolLM2 logits of ~23 (under 1e-6 of the scale). We allow
5e-5 x max|logit| (about 1e-3 for SmolLM2): over 50x what reordering produces, yet a real bug
(a wrong RoPE position, a stale or misplaced KV slot, a bad mask) moves logits by O(0.1-1).
"""

from __future__ import annotations

import pytest
import torch
from conftest import ModelCase, hf_greedy, hf_next_tokens

from kvharbor.engine import SamplingParams

STEPS = 32
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
_REFS: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[torch.Tensor]]] = {}


def reference(case: ModelCase, prompt: list[int], ours: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens and logits at each position of `ours` after `prompt` (teacher-forced:
    the tokens equal `ours` exactly when ours are HF's greedy continuation)."""
    key = (case.name, (*prompt, -1, *ours))
    if key not in _REFS:
        _REFS[key] = hf_next_tokens(case.hf, prompt, ours)
    return _REFS[key]


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_greedy(case: ModelCase, prompts: list[list[int]], ours: list[list[int]]) -> None:
    assert all(len(o) == STEPS for o in ours)
    assert ours == [reference(case, p, o)[0] for p, o in zip(prompts, ours, strict=True)]


def test_logits_of_prompt_and_8_decode_steps_match(model_case, make_llm):
    llm = make_llm(model_case.loaded)
    model = llm.engine.core.model
    captured: list[torch.Tensor] = []
    original = model.logits

    def recording(hidden):
        out = original(hidden)
        captured.append(out.detach().clone())
        return out

    model.logits = recording
    for prompt in model_case.prompts[::3]:
        captured.clear()
        out = llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
        ref = reference(model_case, prompt, out[0].outputs[0].token_ids)[1]
        assert len(captured) == 9
        for step, (ours, theirs) in enumerate(zip(captured, ref, strict=True)):
            scale = theirs.abs().max().item()
            diff = (ours[0] - theirs).abs().max().item()
            assert diff <= 5e-5 * scale, f"step {step}: logits differ by {diff:.2e} (scale {scale:.1f})"


def test_greedy_one_at_a_time(model_case, make_llm):
    llm = make_llm(model_case.loaded)
    # SmolLM2 decodes one sequence at ~15 tok/s here: half its prompts (the rest run batched below).
    prompts = model_case.prompts[::2] if model_case.name == "smollm2" else model_case.prompts
    for prompt in prompts:
        assert_greedy(model_case, [prompt], tokens_of(llm.generate([prompt], GREEDY)))


def test_greedy_staggered_arrivals(model_case, make_llm):
    llm = make_llm(model_case.loaded)
    engine = llm.engine
    pending = list(enumerate(model_case.prompts))
    done: dict[int, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(2 if steps % 3 == 0 else 0):  # two arrivals every third step
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(f"s{i}", None, GREEDY, prompt_token_ids=prompt)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.outputs[0].token_ids
        steps += 1
        assert steps < 2000
    assert_greedy(model_case, model_case.prompts, [done[i] for i in range(len(model_case.prompts))])


def test_greedy_with_shared_prefixes_hits_the_cache(model_case, make_llm):
    llm = make_llm(model_case.loaded)
    outs = llm.generate(model_case.shared_prompts, GREEDY)
    assert_greedy(model_case, model_case.shared_prompts, tokens_of(outs))
    hits = [o.num_cached_tokens for o in outs]
    assert sum(h > 0 for h in hits) >= len(hits) - 1, hits
    assert llm.engine.core.kv.prefix_hits > 0


def test_greedy_with_a_tiny_token_budget_chunks_prefill(model_case, make_llm):
    llm = make_llm(model_case.loaded, max_num_batched_tokens=8)
    longest = max(len(p) for p in model_case.prompts)
    assert longest > 8  # so every long prompt is prefilled in several chunks
    outs = llm.generate(model_case.prompts, GREEDY)
    assert_greedy(model_case, model_case.prompts, tokens_of(outs))


def test_greedy_with_a_pool_small_enough_to_preempt(model_case, make_llm):
    longest = max(len(p) for p in model_case.prompts) + STEPS
    blocks = -(-longest // 16) + 2
    # (blocks - 1) * 16: a sliding-window model keeps one block back as the null block
    llm = make_llm(model_case.loaded, num_kv_blocks=blocks, max_model_len=(blocks - 1) * 16)
    outs = llm.generate(model_case.prompts, GREEDY)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_greedy(model_case, model_case.prompts, tokens_of(outs))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_switch_changes_speed_not_tokens(smollm_case, make_llm, prefix_caching):
    llm = make_llm(smollm_case.loaded, enable_prefix_caching=prefix_caching)
    prompts = smollm_case.shared_prompts[:3]
    outs = llm.generate(prompts, GREEDY)
    assert_greedy(smollm_case, prompts, tokens_of(outs))
    assert (llm.engine.core.kv.prefix_hits > 0) == prefix_caching


def test_a_repeated_block_aligned_prompt_recomputes_only_its_last_block(model_case, make_llm):
    llm = make_llm(model_case.loaded)
    prompt = (model_case.prompts[-1] * 2)[:32]  # exactly two blocks of 16
    first, second = llm.generate([prompt], GREEDY), llm.generate([prompt], GREEDY)
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 16  # the last token must run, so its block does too
    assert tokens_of(first) == tokens_of(second)
    assert_greedy(model_case, [prompt], tokens_of(first))


WINDOWED = ["tiny-mistral-window", "tiny-gemma2", "tiny-gemma3"]


@pytest.mark.parametrize("case", WINDOWED)
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["decode-kernel", "torch-only"])
def test_windowed_models_match_on_the_batched_paths(case, cpu_kernels, request, make_llm):
    """The cases above run batch-invariant (every row through the CPU kernel's window argument).
    Here the other paths: decode groups (or the kernel) and prefill chunks with banded masks,
    soft-caps through the explicit softmax, in chunks small enough that the band crosses them."""
    model_case = request.getfixturevalue(case.replace("-", "_"))
    llm = make_llm(model_case.loaded, batch_invariant="off", cpu_kernels=cpu_kernels, max_num_batched_tokens=24)
    prompts = model_case.prompts + model_case.shared_prompts[:4]
    assert_greedy(model_case, prompts, tokens_of(llm.generate(prompts, GREEDY)))
    assert llm.engine.core.kv.prefix_hits > 0


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["decode-kernel", "torch-only"])
def test_a_sliding_window_model_runs_a_context_longer_than_its_pool(cpu_kernels, tiny_mistral_window, make_llm):
    """Every Mistral layer slides (window 20): the KV manager releases blocks the window passed,
    so 6 blocks of 16 tokens (one the null block) run two 110-token prompts and their 40-token
    continuations, 10 blocks each without the release, exactly as transformers, preempting one
    to make room for the other."""
    case = tiny_mistral_window
    llm = make_llm(case.loaded, num_kv_blocks=6, max_model_len=256, max_num_batched_tokens=24, cpu_kernels=cpu_kernels,
                   kv_cache_memory=None)  # fmt: skip
    assert llm.engine.core.max_model_len == 256 and llm.engine.core.load().kv_blocks_total == 5
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (110,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(case.hf, prompt, 40)[0]
    assert llm.engine.core.kv.window_released >= 2 * (150 - 20 - 24) // 16  # most of each sequence released
    assert llm.engine.core.scheduler.num_preemptions > 0  # two at once do not fit: one was preempted, and resumed


def test_a_pool_too_small_even_for_the_window_is_refused(tiny_mistral_window, make_llm):
    with pytest.raises(ValueError, match=r"one 256-token request needs 5"):
        make_llm(tiny_mistral_window.loaded, num_kv_blocks=4, max_model_len=256, max_num_batched_tokens=24,
                 kv_cache_memory=None)  # fmt: skip
