"""Speculative decoding: the acceptance rule keeps the target's distribution exactly (the seeds'
worked example, and a naive rule that the same test rejects), the engine's greedy tokens are the
same with speculation on and off, its sampled tokens are distributed the same, and rejected
tokens leave no blocks or hashes behind."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvharbor.common.block_hash import block_hashes
from kvharbor.engine import SamplingParams
from kvharbor.engine.rejection import accept_greedy, accept_sampled
from kvharbor.engine.spec.proposers import AdaptiveK, NgramProposer, Proposal, ngram_lookup

# Chi-square critical values at alpha = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
            10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 16: 39.252}  # fmt: skip


def chi2_critical(dof: int) -> float:
    """The alpha = 0.001 critical value: the table, else Wilson-Hilferty (within 0.5% above 16 dof)."""
    if dof in CHI2_999:
        return CHI2_999[dof]
    z = 3.090232  # the standard normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def chi_square_gof(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


P = torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]])  # row 1 is only drawn from if all k = 1 accepted
Q = torch.tensor([[0.5, 0.2, 0.3]])
# The naive rule below comes out as (0.62, 0.26, 0.12): its chi-square statistic grows as
# 0.01 x DRAWS, about 200 here against a critical value of 13.8, so 20,000 draws tell the rules
# apart with room to spare.
DRAWS = 20_000


def first_tokens(rule, q: torch.Tensor | None) -> list[int]:
    gen = torch.Generator().manual_seed(2024)
    proposals = torch.multinomial(Q[0] if q is not None else P[0], DRAWS, replacement=True, generator=gen).tolist()
    counts = Counter(rule(P, [x], q, gen)[0] for x in proposals)
    return [counts[i] for i in range(3)]


def naive(p, draft, q, gen):
    """Wrong on purpose: on rejection it samples from p again instead of from max(0, p - q)."""
    x = draft[0]
    if float(torch.rand((), generator=gen)) < min(1.0, float(p[0, x] / q[0, x])):
        return [x]
    return [int(torch.multinomial(p[0], 1, generator=gen))]


def test_the_seeds_worked_example_gives_p():
    """p = (0.6, 0.3, 0.1), q = (0.5, 0.2, 0.3): drafts drawn from q, run through the acceptance
    rule, come out distributed as p (chi-square goodness of fit, alpha = 0.001, 2 dof)."""
    assert chi_square_gof(first_tokens(accept_sampled, Q), P[0].tolist()) < CHI2_999[2]


def test_the_naive_rule_fails_the_same_test():
    # Proof that the test above can fail: the naive rule over-weights what q likes (token 2).
    assert chi_square_gof(first_tokens(naive, Q), P[0].tolist()) > CHI2_999[2]


def test_a_deterministic_proposer_also_gives_p():
    """q = delta_x (n-gram lookup): accept with p(x), else draw from p without x. Here the
    proposal is always token 2, the least likely: most are rejected and resampled."""
    gen = torch.Generator().manual_seed(7)
    counts = Counter(accept_sampled(P, [2], None, gen)[0] for _ in range(50_000))
    assert chi_square_gof([counts[i] for i in range(3)], P[0].tolist()) < CHI2_999[2]


def test_all_accepted_draws_a_bonus_token_and_greedy_accepts_the_argmax():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled(p, [1, 1], None, torch.Generator().manual_seed(0)) == [1, 1, 2]
    assert accept_greedy([4, 7, 9], [4, 7]) == [4, 7, 9]
    assert accept_greedy([4, 7, 9], [4, 8]) == [4, 7]
    assert accept_greedy([4, 7, 9], [5, 7]) == [4]


def test_ngram_lookup_and_adaptive_k():
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3, 3) == [3, 4, 1]
    assert ngram_lookup([5, 6, 7, 8], 3, 3) == []
    assert ngram_lookup([1, 2, 3, 9, 9, 2, 3, 7, 2, 3], 3, 2) == [7, 2]  # falls back to the 2-gram, latest first
    proposer = NgramProposer(3)

    class Req:
        request_id, all_token_ids = "r", [1, 2, 3, 1, 2]

    assert proposer.propose([Req()], {"r": 4})["r"].tokens == [3, 1, 2]
    adaptive = AdaptiveK(4)
    assert adaptive.k_for(Req()) == 4
    for _ in range(10):
        adaptive.record(Req(), 4, 0)
    ks = [adaptive.k_for(Req()) for _ in range(32)]
    assert set(ks) == {0, 1} and ks.count(1) == 2  # off, with a probe every 16 steps


# -- the engine ------------------------------------------------------------------------------------


def repetitive_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """Prompts with repeated spans, so n-gram lookup has something to propose."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        motif = [rng.randrange(3, vocab) for _ in range(5 + i % 4)]
        prompts.append([rng.randrange(3, vocab) for _ in range(i)] + motif * (3 + i % 3) + motif[:2])
    return prompts


def generate(make_llm, loaded, prompts, params, **options):
    llm = make_llm(loaded, **options)
    outs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_are_identical_with_speculation_on_and_off(make_llm, tiny_llama, k):
    prompts = repetitive_prompts(512, 8, seed=k) + tiny_llama.shared_prompts[:4]  # prefix hits too
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    # A pool this small forces preemptions in a batch of 12.
    small = {"num_kv_blocks": 40, "block_size": 16, "max_num_batched_tokens": 96}
    _, off = generate(make_llm, tiny_llama.loaded, prompts, params, **small)
    # A random model rarely repeats itself: 1-grams give the proposer something to try.
    llm, on = generate(make_llm, tiny_llama.loaded, prompts, params, speculative_method="ngram",
                       speculative_k=k, ngram_n=1, **small)  # fmt: skip
    assert on == off
    stats = llm.engine.core.stats
    assert stats.spec_verifications > 0 and stats.spec_accepted < stats.spec_proposed
    assert llm.engine.core.scheduler.num_preemptions > 0


class OracleProposer:
    """Proposes the true greedy continuation, with every fourth position corrupted: long accepted
    runs and rejections at known places (the n-gram proposer on a random model accepts little)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference

    def propose(self, requests, ks):
        out = {}
        for r in requests:
            done = len(r.output_token_ids)
            tokens = self.reference[tuple(r.prompt_token_ids)][done : done + ks[r.request_id]]
            tokens = [t if (done + i) % 4 != 3 else (t + 1) % 512 for i, t in enumerate(tokens)]
            if tokens:
                out[r.request_id] = Proposal(tokens)
        return out

    def release(self, request):
        pass


@pytest.mark.parametrize("k", [3, 5])
def test_long_accepted_runs_and_rejections_keep_greedy_tokens(make_llm, tiny_llama, k):
    prompts = repetitive_prompts(512, 10, seed=20 + k)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = {"num_kv_blocks": 32, "block_size": 16, "max_num_batched_tokens": 96}
    _, off = generate(make_llm, tiny_llama.loaded, prompts, params, **small)
    llm = make_llm(tiny_llama.loaded, speculative_method="ngram", speculative_k=k, **small)
    llm.engine.core.proposer = OracleProposer({tuple(p): o for p, o in zip(prompts, off, strict=True)})
    llm.engine.core.adaptive_k = AdaptiveK(k, off_below=0.0)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert on == off
    stats = llm.engine.core.stats
    assert stats.spec_accepted > stats.spec_verifications  # more than one accepted per step on average
    assert stats.spec_accepted < stats.spec_proposed
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.slow  # over 10 s here
def test_greedy_smollm2_is_identical_with_speculation(make_llm, smollm):
    tok = smollm.tokenizer
    text = "The committee met on Tuesday and agreed to publish the annual report in March."
    chats = [
        f"Repeat this sentence exactly: {text}",
        f"Rewrite with one word changed: {text}",
        "Write a Python function that returns the sum of a list, then the same function with a docstring.",
    ]
    prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": c}])} for c in chats]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    base, off = generate(make_llm, smollm, prompts, params)
    llm, on = generate(make_llm, smollm, prompts, params, speculative_method="ngram", speculative_k=3)
    assert on == off
    assert llm.engine.core.stats.spec_accepted > 0
    # A stop string inside a run of accepted tokens ends the answer where one at a time would.
    stop = SamplingParams(max_tokens=24, temperature=0.0, stop=["annual"])
    plain = base.generate(prompts[:1], stop)[0].outputs[0]
    spec = llm.generate(prompts[:1], stop)[0].outputs[0]
    assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, "stop")


class ModeProposer:
    """Always proposes the most common token of each position (from a run without speculation):
    likely enough to be accepted often, and rejected often too."""

    def __init__(self, modes: list[int]) -> None:
        self.modes = modes

    def propose(self, requests, ks):
        out = {}
        for r in requests:
            done = len(r.output_token_ids)
            if self.modes[done : done + ks[r.request_id]]:
                out[r.request_id] = Proposal(self.modes[done : done + ks[r.request_id]])
        return out

    def release(self, request):
        pass


def homogeneity_chi2(a: Counter, b: Counter, min_count: int = 20) -> tuple[float, int]:
    """Chi-square test of homogeneity of two samples of tokens (tokens rarer than min_count pooled)."""
    common = [t for t in a | b if a[t] + b[t] >= min_count]
    rows = [[c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)] for c in (a, b)]
    cols = [i for i in range(len(rows[0])) if rows[0][i] + rows[1][i] > 0]
    total = sum(map(sum, rows))
    stat = 0.0
    for i in cols:
        col = rows[0][i] + rows[1][i]
        for row in rows:
            expected = sum(row) * col / total
            stat += (row[i] - expected) ** 2 / expected
    return stat, len(cols) - 1


@pytest.mark.slow  # over 10 s here
def test_sampled_tokens_keep_their_distribution(make_llm, tiny_llama):
    """Temperature 1: the first three tokens over 5,000 seeds each, with and without speculation
    (independent seeds). Chi-square tests at alpha = 0.001: homogeneity per position (rare tokens
    pooled), and 2x2 on how often the proposed token comes out, where a wrong acceptance rule
    shows first (the naive "resample from p" rule fails it)."""
    prompt = repetitive_prompts(512, 1, seed=11)[0]
    prompts = [prompt] * 5000

    def params(first_seed: int) -> list[SamplingParams]:
        # Independent samples: the same seeds on both sides would pair the draws.
        seeds = range(first_seed, first_seed + 5000)
        return [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]

    _, off = generate(make_llm, tiny_llama.loaded, prompts, params(0))
    modes = [Counter(t[i] for t in off).most_common(1)[0][0] for i in range(3)]
    llm = make_llm(tiny_llama.loaded, speculative_method="ngram", speculative_k=2)
    llm.engine.core.proposer = ModeProposer(modes)
    llm.engine.core.adaptive_k = AdaptiveK(2, off_below=0.0)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params(1_000_000))]
    stats = llm.engine.core.stats
    assert stats.spec_verifications > 500 and 0 < stats.spec_accepted < stats.spec_proposed
    for position in range(3):
        stat, dof = homogeneity_chi2(Counter(t[position] for t in off), Counter(t[position] for t in on))
        assert dof >= 1 and stat < chi2_critical(dof), f"position {position}: chi2 {stat:.1f} with {dof} dof"
    for position in (1, 2):  # the positions tokens were proposed for
        a = sum(t[position] == modes[position] for t in off)
        b = sum(t[position] == modes[position] for t in on)
        stat, _ = homogeneity_chi2(Counter({"mode": a, "other": len(off) - a}),
                                   Counter({"mode": b, "other": len(on) - b}), min_count=0)  # fmt: skip
        assert stat < CHI2_999[1], f"position {position}: the proposed token came out {a} vs {b} times"


def test_rejected_tokens_leave_no_blocks_and_no_hashes(make_llm, tiny_llama):
    prompts = repetitive_prompts(512, 6, seed=5)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, reference = generate(make_llm, tiny_llama.loaded, prompts, greedy)
    llm = make_llm(tiny_llama.loaded, speculative_method="ngram", speculative_k=5, block_size=16)
    # Greedy guesses for sampled requests: off track after the first difference, so mostly rejected.
    llm.engine.core.proposer = OracleProposer({tuple(p): o for p, o in zip(prompts, reference, strict=True)})
    llm.engine.core.adaptive_k = AdaptiveK(5, off_below=0.0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
    engine = llm.engine
    assert engine.core.stats.spec_proposed - engine.core.stats.spec_accepted > 50  # many rejections happened
    engine.core.check_integrity()
    real = set()
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        real.update(block_hashes(tokens, 16, engine.core.model_name))
    assert engine.core.pool.cached and set(engine.core.pool.cached) <= real  # every hash is of tokens that were kept


def test_a_request_can_opt_out(make_llm, tiny_llama):
    llm = make_llm(tiny_llama.loaded, speculative_method="ngram")
    llm.generate(repetitive_prompts(512, 2, seed=1), SamplingParams(max_tokens=16, temperature=0, speculative=False))
    assert llm.engine.core.stats.spec_verifications == 0


def test_acceptance_rate_and_mean_accepted_length_are_reported(make_llm, tiny_llama):
    from kvharbor.engine.serve.metrics import ServerMetrics

    llm = make_llm(tiny_llama.loaded, speculative_method="ngram", speculative_k=3, ngram_n=1)
    llm.generate(repetitive_prompts(512, 4, seed=2), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stats = llm.engine.core.stats
    assert stats.spec_proposed > 0
    assert llm.engine.core.load().spec_acceptance_rate == round(stats.spec_accepted / stats.spec_proposed, 4)
    counters, load = llm.engine.core.counters(), llm.engine.core.load()  # what the engine loop sends after a step
    text = ServerMetrics(lambda: (load, counters), "m", "i").render().decode()
    rate = stats.spec_accepted / stats.spec_proposed
    assert f'kvharbor_spec_acceptance_rate{{instance="i",model="m"}} {rate}' in text
    mean = stats.spec_accepted / stats.spec_verifications
    assert f'kvharbor_spec_mean_accepted_length{{instance="i",model="m"}} {mean}' in text


# -- the draft-model proposer ----------------------------------------------------------------------


def test_a_draft_model_keeps_greedy_tokens_and_frees_its_cache(make_llm, tiny_llama, tiny_qwen2):
    prompts = repetitive_prompts(512, 8, seed=9) + tiny_llama.shared_prompts[:3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, off = generate(make_llm, tiny_llama.loaded, prompts, params, num_kv_blocks=48, block_size=16)
    for draft, all_accepted in ((tiny_llama, True), (tiny_qwen2, False)):
        llm, on = generate(make_llm, tiny_llama.loaded, prompts, params, num_kv_blocks=48, block_size=16,
                           speculative_method="draft", draft_model=str(draft.loaded.path), speculative_k=3)  # fmt: skip
        assert on == off, draft.name
        stats, proposer = llm.engine.core.stats, llm.engine.core.proposer
        assert stats.spec_verifications > 0
        # The target as its own draft is always right; another model mostly is not.
        assert (stats.spec_accepted == stats.spec_proposed) == all_accepted, stats
        assert proposer.pool.num_free == proposer.pool.num_blocks and not proposer.shadows
        proposer.kv.check_integrity()


@pytest.mark.slow  # over 10 s here
def test_a_draft_model_keeps_the_sampled_distribution(make_llm, tiny_llama, tiny_qwen2):
    """q is a real distribution here (not a point): accept with min(1, p/q), else draw from
    max(0, p - q). Same tests as for the deterministic proposer."""
    prompt = repetitive_prompts(512, 1, seed=11)[0]

    def params(first_seed: int) -> list[SamplingParams]:
        seeds = range(first_seed, first_seed + 3000)
        return [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]

    _, off = generate(make_llm, tiny_llama.loaded, [prompt] * 3000, params(0))
    llm, on = generate(make_llm, tiny_llama.loaded, [prompt] * 3000, params(1_000_000), speculative_method="draft",
                       draft_model=str(tiny_qwen2.loaded.path), speculative_k=2)  # fmt: skip
    stats = llm.engine.core.stats
    assert stats.spec_verifications > 500 and 0 < stats.spec_accepted < stats.spec_proposed
    for position in range(3):
        stat, dof = homogeneity_chi2(Counter(t[position] for t in off), Counter(t[position] for t in on))
        assert dof >= 1 and stat < chi2_critical(dof), f"position {position}: chi2 {stat:.1f} with {dof} dof"


def test_a_draft_model_must_share_the_vocabulary(tmp_path, tiny_llama):
    from tiny_models import hf_model

    from kvharbor.engine import LLM

    hf_model(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(loaded_model=tiny_llama.loaded, dtype="float32", kv_cache_memory="64MiB", max_model_len=512,
            speculative_method="draft", draft_model=str(tmp_path))  # fmt: skip
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(loaded_model=tiny_llama.loaded, dtype="float32", speculative_method="draft")


def test_speculative_options_as_one_dict(make_llm, tiny_llama):
    llm = make_llm(tiny_llama.loaded, speculative={"method": "ngram", "k": 5, "ngram_n": 2})
    spec = llm.engine.core.config.speculative
    assert (spec.speculative_method, spec.speculative_k, spec.ngram_n) == ("ngram", 5, 2)
    with pytest.raises(ValueError, match="speculative must be a dict"):
        make_llm(tiny_llama.loaded, speculative={"method": "ngram", "depth": 2})
    with pytest.raises(ValueError, match="speculative_k"):
        make_llm(tiny_llama.loaded, speculative={"method": "ngram", "k": 0})
