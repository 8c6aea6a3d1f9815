"""The public engine API: bad input, n > 1 with copy-on-write, seeds, stop strings, logprobs,
abort, failure handling and length limits. Every engine built here must end idle with all blocks
back in the pool (the make_llm fixture checks on teardown)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from kvharbor.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def smol(smollm, make_llm):
    return make_llm(smollm)


@pytest.fixture
def tiny(tiny_llama, make_llm):
    return make_llm(tiny_llama.loaded)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make_params", "match"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
        (lambda: SamplingParams(temperature=-0.5), r"temperature must be in \[0, 2\]"),
        (lambda: SamplingParams(temperature=float("nan")), r"temperature must be in \[0, 2\]"),
        (lambda: SamplingParams(temperature=2.5), r"temperature must be in \[0, 2\]"),  # the API's range too
        (lambda: SamplingParams(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 10\]"),
        (lambda: SamplingParams(presence_penalty=-2.5), r"presence_penalty must be in \[-2, 2\]"),
        (lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(n=0), "n must be an integer >= 1"),
        (lambda: SamplingParams(stop=[""]), "stop strings must be non-empty"),
        (lambda: SamplingParams(logit_bias={5: float("inf")}), r"logit_bias values must be numbers in \[-100, 100\]"),
        (lambda: SamplingParams(logit_bias={5: float("nan")}), "logit_bias values"),
        (lambda: SamplingParams(logit_bias={"5": 1.0}), "logit_bias keys must be integer"),
    ],
)
def test_bad_sampling_params_raise_clear_value_errors(make_params, match):
    with pytest.raises(ValueError, match=match):
        make_params()


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", GREEDY, "the prompt is empty"),
        ([[]], GREEDY, "the prompt is empty"),
        ([[5, -1, 7]], GREEDY, "token id -1 is outside the vocabulary"),
        ([[5, 49152]], GREEDY, "token id 49152 is outside the vocabulary"),
        ([[1] * 600], GREEDY, "the prompt has 600 tokens but this model's context is 512"),
        ([[1] * 500], SamplingParams(max_tokens=100), "ask for at most 12"),
        ("hi", SamplingParams(n=17), "exceeds the engine's limit of 16"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "outside the vocabulary"),
        ("hi", SamplingParams(logit_bias={-3: 1.0}), "outside the vocabulary"),
    ],
)
def test_bad_requests_raise_and_leak_nothing(smol, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        smol.generate(prompt, params)
    assert not smol.engine.has_unfinished()


def test_one_bad_prompt_in_a_batch_queues_none_of_them(smol):
    with pytest.raises(ValueError, match="empty"):
        smol.generate(["fine", "also fine", ""], GREEDY)
    assert not smol.engine.has_unfinished()
    assert smol.generate("fine", GREEDY)[0].outputs[0].token_ids  # and it still works


def test_sample_ids_never_collide_with_user_ids(tiny):
    engine = tiny.engine
    with pytest.raises(ValueError, match="printable"):
        engine.add_request("a\x1f1", None, GREEDY, prompt_token_ids=[5, 6])
    engine.add_request("a#1", None, SamplingParams(max_tokens=4, ignore_eos=True), prompt_token_ids=[5, 6])
    engine.add_request("a", None, SamplingParams(max_tokens=4, n=2, ignore_eos=True), prompt_token_ids=[7, 8])
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [len(o.token_ids) for o in finished["a#1"].outputs] == [4]
    assert [len(o.token_ids) for o in finished["a"].outputs] == [4, 4]


def test_duplicate_request_ids_are_refused(smol):
    engine = smol.engine
    engine.add_request("dup", "hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", GREEDY)
    engine.abort("dup")
    engine.step()


# -- outputs -----------------------------------------------------------------------------------


def test_chat_answers_like_the_reference(smol):
    out = smol.chat(CAPITAL, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    assert out.outputs[0].finish_reason == "stop"


def test_n_greedy_samples_share_the_prompt_and_all_equal_the_reference(tiny_llama, make_llm):
    llm = make_llm(tiny_llama.loaded)
    prompt = tiny_llama.prompts[4]  # 40 tokens: a partial last block, so copy-on-write must run
    ref, _ = hf_greedy(tiny_llama.hf, prompt, 12)
    engine = llm.engine
    engine.add_request(
        "g", None, SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True), prompt_token_ids=prompt
    )
    engine.step()  # prefill + fork
    tables = [engine.core.kv.block_ids(r) for r in engine.core.scheduler.running]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    assert [o.token_ids for o in final.outputs] == [ref] * 3
    assert [o.index for o in final.outputs] == [0, 1, 2]


def test_n_sampled_outputs_differ_and_are_reproducible(smol):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)
    first = smol.chat(CAPITAL, params)[0]
    second = smol.chat(CAPITAL, params)[0]
    texts = [o.text for o in first.outputs]
    assert texts == [o.text for o in second.outputs]
    assert len(set(texts)) > 1


def test_same_seed_same_output_whatever_the_batch(smol):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = smol.generate("Write a haiku about autumn.", params)[0].outputs[0].token_ids
    batch = smol.generate(
        ["Write a haiku about autumn.", "Another prompt", "And one more prompt here"],
        [params, SamplingParams(max_tokens=16, temperature=1.0), SamplingParams(max_tokens=16, temperature=1.0)],
    )
    assert batch[0].outputs[0].token_ids == alone


def test_stop_strings_cut_the_text(smol):
    full = smol.chat(CAPITAL, SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].text
    out = smol.chat(CAPITAL, SamplingParams(max_tokens=20, temperature=0.0, stop=["Paris", "xyz"]))[0].outputs[0]
    assert out.text == full[: full.index("Paris")] == "The capital of France is "
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    kept = smol.chat(
        CAPITAL, SamplingParams(max_tokens=20, temperature=0.0, stop=["France"], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == "The capital of France"


def test_stop_string_in_a_stream_is_never_shown_in_part(smol):
    engine = smol.engine
    ids = smol.get_tokenizer().encode_chat(CAPITAL)
    engine.add_request("s", None, SamplingParams(max_tokens=20, temperature=0.0, stop=["of Fr"]), prompt_token_ids=ids)
    deltas = []
    while engine.has_unfinished():
        deltas += [o.outputs[0].delta_text for o in engine.step()]
    assert "".join(deltas) == "The capital "
    assert not any("of" in d for d in deltas)


def test_stop_token_text_is_dropped_unless_asked_for(smol):
    paris = 7042  # "The capital of France is Paris." -> [504, 3575, 282, 4649, 314, 7042, 30, 2]
    out = smol.chat(CAPITAL, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[paris]))[0].outputs[0]
    assert out.text == "The capital of France is" and out.token_ids[-1] == paris and out.stop_reason == paris
    kept = smol.chat(
        CAPITAL, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[paris], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == "The capital of France is Paris"


def test_stop_strings_wait_for_min_tokens(smol):
    def answer(min_tokens):
        params = SamplingParams(max_tokens=20, temperature=0.0, stop=["capital"], min_tokens=min_tokens)
        return smol.chat(CAPITAL, params)[0].outputs[0]

    assert answer(1).text == "The "  # "capital" is the 2nd token: past min_tokens=1
    late = answer(2)  # the 2nd token is still within min_tokens: that occurrence does not stop it
    assert late.text == "The capital of France is Paris." and late.finish_reason == "stop"


def test_logprobs_equal_the_reference_log_softmax(smollm_case, smol):
    prompt = smollm_case.prompts[0]
    _, ref_logits = hf_greedy(smollm_case.hf, prompt, 4)
    out = smol.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 4
    for lp, logits in zip(lps, ref_logits, strict=True):
        ref = torch.log_softmax(logits.double(), -1)
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=2e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy takes the most likely


def test_max_model_len_ends_generation_with_length(tiny_llama, make_llm):
    llm = make_llm(tiny_llama.loaded, max_model_len=48)
    out = llm.generate([tiny_llama.prompts[3]], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(tiny_llama.prompts[3]) + len(out[0].outputs[0].token_ids) == 48
    assert out[0].outputs[0].finish_reason == "length"


def test_an_unset_max_model_len_is_capped_to_the_pool_and_logged(tiny_llama, make_llm, caplog):
    # The tiny model allows 512 tokens; 8 blocks of 16 hold 128, so 128 is the context served.
    with caplog.at_level("WARNING", logger="kvharbor.engine"):
        llm = make_llm(tiny_llama.loaded, num_kv_blocks=8, max_model_len=None)
    assert llm.engine.core.max_model_len == 128
    (note,) = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert "capped to 128 tokens" in note and "--num-kv-blocks" in note
    with pytest.raises(ValueError, match="the prompt has 130 tokens but this model's context is 128"):
        llm.generate([[5] * 130], GREEDY)
    with pytest.raises(ValueError, match="ask for at most 28"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=64))
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 28 and out[0].outputs[0].finish_reason == "length"


def test_an_explicit_max_model_len_the_pool_cannot_hold_is_refused(tiny_llama, make_llm):
    with pytest.raises(ValueError, match=r"holds 8 blocks \(128 tokens.*one 512-token request needs 32"):
        make_llm(tiny_llama.loaded, num_kv_blocks=8, max_model_len=512)


# -- abort and failure -------------------------------------------------------------------------


def test_abort_returns_blocks_at_once(smol):
    engine = smol.engine
    engine.add_request("long", "Tell me a long story.", SamplingParams(max_tokens=200, n=2, temperature=1.0))
    engine.add_request("other", "Hello", SamplingParams(max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.core.pool.num_free < engine.core.pool.num_blocks
    engine.abort(["long", "other", "never-existed"])
    assert engine.core.pool.num_free == engine.core.pool.num_blocks  # before any further step
    engine.core.check_integrity()
    outs = {o.request_id: o for o in engine.step()}
    assert outs["long"].finished and {o.finish_reason for o in outs["long"].outputs} == {"abort"}
    assert not engine.has_unfinished()
    load = engine.core.load()
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_blocks_free == load.kv_blocks_total == engine.core.pool.num_blocks


def test_abort_before_the_first_token_finishes_all_n_samples(smol):
    engine = smol.engine
    engine.add_request("early", "Tell me a story.", SamplingParams(max_tokens=20, n=3))
    engine.abort("early")
    (out,) = engine.step()
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished() and not engine.core._groups


def test_a_failed_step_fails_every_sample_of_its_requests(tiny_llama, make_llm, monkeypatch):
    llm = make_llm(tiny_llama.loaded, max_num_batched_tokens=2)
    engine = llm.engine
    engine.add_request(
        "g", None, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True), prompt_token_ids=[5, 6]
    )
    while len(engine.core.scheduler.running) < 3:
        engine.step()
    real = engine.core.runner.execute
    failed = []

    def flaky(plan):
        if not failed:
            failed.append(len(plan.chunks))  # the budget of 2 holds only two of the three samples
            raise RuntimeError("boom")
        return real(plan)

    monkeypatch.setattr(engine.core.runner, "execute", flaky)
    (out,) = engine.step()
    assert failed == [2]
    assert out.finished and [o.finish_reason for o in out.outputs] == ["error"] * 3
    assert not engine.has_unfinished()


def test_a_failed_step_fails_its_requests_frees_them_and_the_engine_goes_on(smol, monkeypatch):
    engine = smol.engine
    real = engine.core.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel fault")
        return real(plan)

    monkeypatch.setattr(engine.core.runner, "execute", flaky)
    engine.add_request("doomed", "This prompt is long enough to fill one block of sixteen tokens easily.", GREEDY)
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert "simulated kernel fault" in outs[0].error.message
    assert outs[0].error.fault == "engine"  # alone in its step: nothing to tell it from the engine
    assert engine.core.pool.num_cached == 0  # half-written KV must never be hit
    assert engine.core.pool.num_free == engine.core.pool.num_blocks
    out = smol.generate("This prompt is long enough to fill one block of sixteen tokens easily.", GREEDY)
    assert out[0].outputs[0].finish_reason == "length"


def test_the_api_and_the_engine_take_the_same_sampling_ranges():
    """One table (common/sampling_limits.py): a value the API refuses, the engine refuses too."""
    from pydantic import ValidationError

    from kvharbor.common.openai_api import CompletionRequest

    for name, bad in [("temperature", 2.5), ("top_p", 0.0), ("min_p", 1.5), ("repetition_penalty", 11.0),
                      ("presence_penalty", 3.0), ("frequency_penalty", -3.0)]:  # fmt: skip
        with pytest.raises(ValidationError, match=name):
            CompletionRequest(model="m", prompt="x", **{name: bad})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})
        edge = {"temperature": 2.0, "top_p": 1.0, "min_p": 1.0, "repetition_penalty": 10.0,
                "presence_penalty": 2.0, "frequency_penalty": -2.0}[name]  # fmt: skip
        CompletionRequest(model="m", prompt="x", **{name: edge})
        SamplingParams(**{name: edge})


def test_continued_text_reaches_the_engine_within_the_same_bound_on_both_sides():
    from pydantic import ValidationError

    from kvharbor.common.openai_api import CompletionRequest
    from kvharbor.common.sampling_limits import MAX_CONTINUED_TEXT

    ok = CompletionRequest(model="m", prompt="x", continued_text="EN", stop=["END"])
    assert SamplingParams(**ok.sampling_kwargs()).continued_text == "EN"
    assert SamplingParams(**CompletionRequest(model="m", prompt="x").sampling_kwargs()).continued_text == ""
    with pytest.raises(ValidationError, match="continued_text"):
        CompletionRequest(model="m", prompt="x", continued_text="x" * (MAX_CONTINUED_TEXT + 1))


def test_a_decoding_engine_reports_the_context_its_steps_read(tiny_llama, make_llm):
    """The decode fit's inputs come from real steps: /load's context is every running sequence's
    prompt plus its output so far, and the measured steps' context lies between the prompts
    alone and their full lengths."""
    llm = make_llm(tiny_llama.loaded)
    engine = llm.engine
    prompts = tiny_llama.prompts[:4]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", params=params, prompt_token_ids=prompt)
    produced = {f"r{i}": 0 for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        running = {r.request_id for r in engine.core.scheduler.running}
        want = sum(len(p) + produced[f"r{i}"] for i, p in enumerate(prompts) if f"r{i}" in running)
        assert engine.core.load().context_tokens == want
    measured = engine.core.load().decode_context_tokens
    assert sum(len(p) for p in prompts) < measured <= sum(len(p) for p in prompts) + 4 * 24


def test_the_offline_engine_holds_a_core_and_forwards_nothing_to_it(tiny_llama, make_llm):
    """LLMEngine puts text at the core's edges; it is not an EngineCore, and it forwards nothing
    (issue 49): the core's parts are read as `engine.core.<part>`."""
    from kvharbor.engine.core import EngineCore
    from kvharbor.engine.llm_engine import LLMEngine

    engine = make_llm(tiny_llama.loaded).engine
    assert isinstance(engine, LLMEngine) and not isinstance(engine, EngineCore)
    assert isinstance(engine.core, EngineCore) and engine.core.kv is not None
    for part in ("kv", "pool", "scheduler", "runner", "adaptive_k"):
        assert not hasattr(engine, part), part
    engine.adaptive_k = object()  # an attribute of the LLMEngine's own: the core's is untouched
    assert engine.core.adaptive_k is None
    with pytest.raises(AttributeError):
        _ = engine.no_such_attribute
