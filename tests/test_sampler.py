"""Sampler: support of top-k/top-p/min-p against transformers' warpers, penalties against its
processors, logprobs against log-softmax, and seeded reproducibility."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvharbor.common.block_hash import namespace_hash
from kvharbor.engine.request import Request
from kvharbor.engine.sampler import Sampler, SampleRow, filtered_probs
from kvharbor.engine.sampling_params import SamplingParams

V = 64


def make_request(rid="r", prompt=(1, 2, 3), outputs=(), **kw) -> Request:
    params = SamplingParams(max_tokens=16, **kw)
    r = Request(rid, list(prompt), params, 16, namespace_hash("m"))
    for t in outputs:
        r.append_output(t)
    return r


def reference_support(logits, temperature, top_k, top_p, min_p):
    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for warper in (
        TemperatureLogitsWarper(temperature),
        TopKLogitsWarper(top_k) if top_k else None,
        TopPLogitsWarper(top_p) if top_p < 1 else None,
        MinPLogitsWarper(min_p) if min_p else None,
    ):
        if warper is not None:
            scores = warper(ids, scores)
    return set(torch.nonzero(scores[0] > float("-inf")).flatten().tolist())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 20, 0.8, 0.05)],
)
def test_filtered_support_matches_transformers(seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    assert support == reference_support(logits, temperature, top_k, top_p, min_p)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    # Inside the support, probabilities keep their relative sizes.
    kept = torch.softmax(logits / temperature, -1)[sorted(support)]
    assert torch.allclose(probs[sorted(support)], kept / kept.sum(), atol=1e-6)


def test_draws_come_only_from_the_support_and_follow_it():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    sampler = Sampler(6, frozenset(), seed=0)
    req = make_request(temperature=1.0, top_k=3, seed=123)
    counts = torch.zeros(6)
    for _ in range(3000):
        tok = sampler._draw(logits, req, 0)
        counts[tok] += 1
    assert counts[3:].sum() == 0
    expected = torch.softmax(logits[:3], -1) * 3000
    assert torch.all((counts[:3] - expected).abs() < 5 * expected.sqrt())


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))

    def run(batch_rows):
        sampler = Sampler(V, frozenset(), seed=99)
        reqs = {f"r{i}": make_request(f"r{i}", temperature=1.0, seed=42 if i == 0 else None) for i in range(3)}
        seq = []
        for _ in range(20):
            rows = [SampleRow(i, reqs[f"r{i}"], 1) for i in batch_rows]
            tokens = sampler.sample(logits[batch_rows], [SampleRow(j, r.request, 1) for j, r in enumerate(rows)]).tokens
            seq.append(tokens["r0"][0])
        return seq

    alone, batched = run([0]), run([0, 1, 2])
    assert alone == batched
    assert len(set(alone)) > 1  # it is really sampling


def test_different_seeds_differ_and_unseeded_requests_differ_from_each_other():
    logits = torch.zeros(1, V)
    sampler = Sampler(V, frozenset(), seed=0)

    def draws(req):
        return [sampler.sample(logits, [SampleRow(0, req, 1)]).tokens[req.request_id][0] for _ in range(16)]

    assert draws(make_request("a", seed=1, temperature=1.0)) != draws(make_request("b", seed=2, temperature=1.0))
    assert draws(make_request("c", temperature=1.0)) != draws(make_request("d", temperature=1.0))


def test_logprobs_are_the_raw_log_softmax_with_top_k():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 2
    req = make_request(temperature=0.5, logprobs=3, repetition_penalty=1.5)
    sampler = Sampler(V, frozenset(), seed=0)
    sampled = sampler.sample(logits[1:], [SampleRow(0, req, 1)])
    tokens, lps = sampled.tokens, sampled.logprobs
    ref = torch.log_softmax(logits[1].double(), -1)
    (lp,) = lps["r"]
    assert lp.token_id == tokens["r"][0]
    assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-5)
    top_ids = torch.topk(ref, 3).indices.tolist()
    assert [t for t, _ in lp.top] == top_ids
    assert [v for _, v in lp.top] == pytest.approx(ref[top_ids].tolist(), abs=1e-5)


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(4)) * 2
    req = make_request(prompt=(1, 5, 9), outputs=(5, 12), repetition_penalty=1.7, temperature=0)
    got = Sampler(V, frozenset(), seed=0).adjust(logits, req)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([req.all_token_ids]), logits[None].clone())[0]
    assert torch.allclose(got, ref)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(V)
    req = make_request(prompt=(3,), outputs=(5, 5, 9), presence_penalty=0.5, frequency_penalty=0.25, temperature=0)
    got = Sampler(V, frozenset(), seed=0).adjust(logits, req)
    assert got[5].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert got[9].item() == pytest.approx(-(0.5 + 0.25))
    assert got[3].item() == 0.0


def test_greedy_with_logit_bias_and_min_tokens():
    logits = torch.zeros(1, V)
    logits[0, 2] = 5.0  # EOS is the argmax
    sampler = Sampler(V, frozenset({2}), seed=0)
    early = make_request(temperature=0, min_tokens=1, logit_bias={7: 1.0})
    assert sampler.sample(logits, [SampleRow(0, early, 1)]).tokens["r"] == [7]
    late = make_request(temperature=0, min_tokens=1, outputs=(4,))
    assert sampler.sample(logits, [SampleRow(0, late, 1)]).tokens["r"] == [2]


def test_n_samples_from_one_row_use_distinct_seeded_streams():
    logits = torch.zeros(1, V)
    sampler = Sampler(V, frozenset(), seed=0)
    req = make_request(temperature=1.0, seed=5, n=4)
    first = sampler.sample(logits, [SampleRow(0, req, 4)]).tokens["r"]
    twin = make_request(temperature=1.0, seed=5, n=4)
    again = Sampler(V, frozenset(), seed=1).sample(logits, [SampleRow(0, twin, 4)])
    assert first == again.tokens["r"]
    assert len(set(first)) > 1


@pytest.mark.parametrize("temperature", [2.36e-181, 1e-12, 9.9e-6])
def test_a_vanishing_temperature_samples_the_argmax_instead_of_nan(temperature):
    # Found by the fuzz test: logits / 2.36e-181 overflow to inf, and softmax of inf is NaN.
    logits = torch.randn(1, V) * 30
    sampler = Sampler(V, frozenset({2}), seed=0)
    request = make_request(temperature=temperature, seed=1)
    assert request.params.greedy
    assert sampler.sample(logits, [SampleRow(0, request, 1)]).tokens["r"] == [int(logits[0].argmax())]
    assert not make_request(temperature=1e-4).params.greedy  # a small but usable temperature still samples
