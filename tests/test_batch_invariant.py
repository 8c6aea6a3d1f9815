"""Batch-invariant mode (--batch-invariant): a request's tokens and logprobs are the same bits
whatever it shares a step with, however its prompt is chunked, and wherever its prefix KV came
from: the request run alone on a fresh engine is the reference, in float32 and in bfloat16
(bfloat16 runs on every x86-64 CPU, emulated where it has no native support, so none of this
depends on the CPU kind).

Exact equality of logprobs is the test: greedy tokens alone would hide a drift until it flips an
argmax, which in bfloat16 happens within a few dozen tokens (the README's first answer did).
"""

from __future__ import annotations

import pytest

from kvharbor.engine import SamplingParams
from kvharbor.engine.cpu.cpu_kernels import load

pytestmark = pytest.mark.skipif(load(2) is None, reason="batch-invariant mode needs kvharbor's CPU kernels")

STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
TOKENS = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
DTYPES = ["float32", "bfloat16"]


# Gemma 3: sliding windows, its gelu kernel and float32 (1 + w) norms on the invariant path too.
@pytest.fixture(params=["tiny-llama", "tiny-qwen2", "tiny-gemma3"])
def case(request):
    return request.getfixturevalue(request.param.replace("-", "_"))


def results(outs) -> list[tuple[list[int], list[float]]]:
    """Each request's tokens and the logprob of each, compared exactly."""
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def alone(
    make_llm, case, dtype: str, prompts: list[list[int]], params=GREEDY, **options
) -> list[tuple[list[int], list[float]]]:
    """The reference: each prompt alone, on an engine with no cache to hit."""
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on", enable_prefix_caching=False, **options)
    return [results(llm.generate([p], params))[0] for p in prompts]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_equals_each_request_alone(case, make_llm, dtype):
    want = alone(make_llm, case, dtype, case.prompts)
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on")
    assert llm.engine.core.batch_invariant
    assert results(llm.generate(case.prompts, GREEDY)) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_batched_and_chunked_equal_alone(case, make_llm, dtype, quantization):
    # Their kernel switches to float sums above 32 rows: invariant mode keeps every row on the
    # integer path (and widens bfloat16 rows for it).
    want = alone(make_llm, case, dtype, case.prompts, quantization=quantization)
    for chunk in (1024, 7):
        llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on", quantization=quantization,
                       max_num_batched_tokens=chunk)  # fmt: skip
        assert results(llm.generate(case.prompts, GREEDY)) == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_chunk(case, make_llm, dtype):
    want = alone(make_llm, case, dtype, case.prompts)
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on", max_num_batched_tokens=7)
    assert results(llm.generate(case.prompts, GREEDY)) == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefix_from_the_cache_equals_one_computed_here(case, make_llm, dtype):
    want = alone(make_llm, case, dtype, case.shared_prompts)
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on")
    got = [results(llm.generate([p], GREEDY))[0] for p in case.shared_prompts]  # each hits the ones before
    assert llm.engine.core.kv.prefix_hits > 0
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption_and_recompute_equal_an_unbroken_run(case, make_llm, dtype):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    want = alone(make_llm, case, dtype, case.prompts, params)
    longest = max(len(p) for p in case.prompts) + 32
    blocks = -(-longest // 16) + 2
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on", num_kv_blocks=blocks, max_model_len=blocks * 16)
    got = results(llm.generate(case.prompts, params))
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculative_verification_equals_plain_decoding(case, make_llm, dtype):
    # Prompts that hold most of the tiny vocabulary, so the 1-gram proposer finds nearly every
    # token the random-weight model generates and proposes what followed it.
    prompts = [list(range(3 + i, 400 + i)) for i in range(3)]
    want = alone(make_llm, case, dtype, prompts)
    speculative = {"method": "ngram", "k": 3, "ngram_n": 1}
    llm = make_llm(case.loaded, dtype=dtype, batch_invariant="on", speculative=speculative)
    got = results(llm.generate(prompts, GREEDY))
    assert llm.engine.core.stats.spec_proposed > 0
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_migrated_stream_continues_with_the_same_bits(case, make_llm, dtype):
    # What the gateway does when an engine dies mid-stream: the prompt plus the tokens already
    # streamed go to another engine as a new prompt, in whatever batch that engine runs.
    want = alone(make_llm, case, dtype, case.prompts[:4])
    cut = 5
    resumed = [p + tokens[:cut] for p, (tokens, _) in zip(case.prompts[:4], want, strict=True)]
    other = make_llm(case.loaded, dtype=dtype, batch_invariant="on")
    rest = SamplingParams(max_tokens=STEPS - cut, temperature=0.0, ignore_eos=True, logprobs=0)
    got = results(other.generate(resumed + case.prompts[4:], rest))[:4]
    assert got == [(tokens[cut:], lps[cut:]) for tokens, lps in want]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pd_hand_off_equals_one_engine(case, make_llm, dtype):
    prompt = case.prompts[-1]
    (want,) = alone(make_llm, case, dtype, [prompt])
    prefill, decode = (make_llm(case.loaded, dtype=dtype, batch_invariant="on") for _ in range(2))
    prefill.engine.add_request("p", prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0),
                               hand_off="p")  # fmt: skip
    first = _finish(prefill.engine)["p"].outputs[0].token_ids[0]
    hashes, payloads = prefill.engine.core.handoffs.export("p", 0, prefill.engine.core.handoffs.size("p"))
    assert decode.engine.core.import_prefix(hashes, payloads) == len(prompt) // 16
    # A continuation reports no logprobs (its first token's were the prefill engine's): tokens only.
    decode.engine.add_request("d", prompt_token_ids=prompt, params=TOKENS, first_token=first)
    out = _finish(decode.engine)["d"]
    prefill.engine.core.handoffs.release("p")
    assert out.num_cached_tokens == len(prompt) // 16 * 16
    assert out.outputs[0].token_ids == want[0]


def _finish(engine) -> dict:
    finals = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish in 1,000 steps")


def test_on_where_it_cannot_run_says_why(tiny_llama, make_llm):
    with pytest.raises(ValueError, match="fp8"):
        make_llm(tiny_llama.loaded, batch_invariant="on", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="cpu-kernels"):
        make_llm(tiny_llama.loaded, batch_invariant="on", cpu_kernels=False)
    with pytest.raises(ValueError, match="batch_invariant"):
        make_llm(tiny_llama.loaded, batch_invariant="sometimes")


def test_auto_stands_down_where_it_cannot_run(tiny_llama, make_llm):
    assert make_llm(tiny_llama.loaded).engine.core.batch_invariant
    assert not make_llm(tiny_llama.loaded, kv_cache_dtype="fp8").engine.core.batch_invariant
    assert not make_llm(tiny_llama.loaded, batch_invariant="off").engine.core.batch_invariant
    # Quantized weights: on where both modes run the packed integer GEMM (AVX512-VNNI); elsewhere it
    # would round every prefill row's activations to int8 on the integer tiles (a quality cost).
    kernels = load(2)
    quantized = make_llm(tiny_llama.loaded, quantization="int8").engine.core.batch_invariant
    assert quantized == kernels.int_packs()
    before = kernels.lanes()
    try:
        kernels.lanes(8)  # the linears as on a CPU without AVX-512: no packed integer GEMM
        assert not make_llm(tiny_llama.loaded, quantization="int8").engine.core.batch_invariant
    finally:
        kernels.lanes(before)
    assert make_llm(tiny_llama.loaded, quantization="int8", batch_invariant="on").engine.core.batch_invariant


def test_the_control_without_the_mode_chunking_changes_the_bits(tiny_llama, make_llm):
    """The equality tests above can fail: with the mode off, a prompt prefilled 7 rows at a time
    (the kernels' decode-sized path) and in one chunk (oneDNN or MKL, torch's pointwise ops) sums
    in different orders, and some logprob differs."""
    prompts = tiny_llama.prompts[-3:]  # 64-100 tokens: one chunk is well past the kernels' 16 rows
    whole = make_llm(tiny_llama.loaded, batch_invariant="off")
    chunked = make_llm(tiny_llama.loaded, batch_invariant="off", max_num_batched_tokens=7)
    want = [results(whole.generate([p], GREEDY))[0] for p in prompts]
    assert [results(chunked.generate([p], GREEDY))[0] for p in prompts] != want
