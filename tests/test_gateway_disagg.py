"""The gateway's per-request P/D decision (gateway/disagg.py), over polled loads: a prefill
engine is used when it spares the decode engine more prefill time than the KV transfer costs,
and never when it would miss a TTFT that colocated serving meets."""

from __future__ import annotations

import pytest

from kvharbor.common.load_report import LoadReport
from kvharbor.gateway.disagg import Request, decide, decode_candidates, prefill_pool, pull_rate, transfer_s
from kvharbor.gateway.engines import Engine

BS = 16
KV_BYTES = 46_080  # SmolLM2 in float32, per token


def engine(
    url: str,
    role: str,
    rate: float = 1000.0,
    waiting: int = 0,
    transfer_bps: float = 0.0,
    step_ms: float = 0.0,
    transfer_age_s: float = 0.0,
) -> Engine:
    load = LoadReport(role=role, prefill_tokens_per_s=rate, waiting_prefill_tokens=waiting,
                      kv_bytes_per_token=KV_BYTES, kv_transfer_bytes_per_s=transfer_bps,
                      kv_transfer_age_s=transfer_age_s, decode_step_ms=step_ms, decode_batch=1.0)  # fmt: skip
    e = Engine(url, "m", url[-1], load)
    e.polled = True
    return e


def request(
    prompt: int, held: dict | None = None, slo: float = 2.0, supported: bool = True, max_tokens: int | None = None
) -> Request:
    return Request(prompt, held or {}, BS, slo, supported, max_tokens)


DECODE, PREFILL = engine("http://d", "decode"), engine("http://p", "prefill")


def test_a_long_prompt_goes_to_the_prefill_engine():
    d = decide(DECODE, [PREFILL], request(2048), min_gain_s=0.05)
    assert d.disaggregated and d.prefill is PREFILL and d.reason == "disaggregated"
    # 2.048 s of prefill spared, less 2048 x 46 KB at the default 500 MB/s (0.19 s)
    assert d.gain_s == pytest.approx(2.048 - 2048 * KV_BYTES / 500e6)


def test_short_prompts_and_warm_caches_stay_colocated():
    assert decide(DECODE, [PREFILL], request(40), 0.05).reason == "short_prompt"  # 40 ms < 50 ms
    assert decide(DECODE, [PREFILL], request(8), 0.0).reason == "short_prompt"  # not one block to hand over
    warm = request(2048, held={DECODE.url: 2048 // BS - 2})  # the decode engine holds all but 2 blocks
    assert decide(DECODE, [PREFILL], warm, 0.05).reason == "short_prompt"


def test_a_slow_link_makes_the_transfer_not_pay():
    slow = engine("http://d", "decode", transfer_bps=20e6)  # 20 MB/s measured: 4.7 s for 2048 tokens
    d = decide(slow, [PREFILL], request(2048), 0.05)
    assert d.reason == "short_prompt" and d.gain_s < 0
    assert transfer_s(slow, request(2048), pull_rate(slow.load)) == pytest.approx(2048 * KV_BYTES / 20e6)


def test_a_busy_prefill_engine_is_not_used_when_only_it_would_miss_the_ttft():
    busy = engine("http://p", "prefill", waiting=10_000)  # 10 s of queued prefill
    d = decide(DECODE, [busy], request(512, slo=2.0), 0.05)  # colocated: 0.5 s, P/D: 10.5 s
    assert d.reason == "ttft" and not d.disaggregated
    # ... but it is when it still meets the SLO, and when colocated serving would miss it too
    assert decide(DECODE, [busy], request(512, slo=30.0), 0.05).disaggregated
    assert decide(DECODE, [busy], request(2048, slo=1.0), 0.05).disaggregated  # 2 s here: protect the decodes


def test_the_least_loaded_prefill_engine_with_the_prefix_wins():
    a, b = engine("http://a", "prefill", waiting=3000), engine("http://b", "prefill")
    assert decide(DECODE, [a, b], request(2048), 0.05).prefill is b
    holds = request(2048, held={a.url: 2048 // BS})  # a holds the whole prompt: its queue only
    assert decide(DECODE, [engine("http://a", "prefill", waiting=1000), b], holds, 0.05).prefill.url == a.url


def test_no_prefill_engine_unsupported_requests_and_unmeasured_engines():
    assert decide(DECODE, [], request(2048), 0.05, configured=False).reason == "no_prefill_engine"
    assert decide(DECODE, [], request(2048), 0.05, configured=True).reason == "prefill_down"
    assert decide(DECODE, [PREFILL], request(2048, supported=False), 0.05).reason == "unsupported"
    cold = engine("http://d", "decode", rate=0.0), engine("http://p", "prefill", rate=0.0)
    assert decide(*cold[:1], [cold[1]], request(2048), 0.05).disaggregated  # no evidence against the pool
    # a decode engine that has only continued hand-offs borrows the prefill engine's rate
    d = decide(engine("http://d", "decode", rate=0.0), [PREFILL], request(2048), 0.05)
    assert d.gain_s == pytest.approx(2.048 - 2048 * KV_BYTES / 500e6)


def test_roles_split_the_pool():
    both = engine("http://b", "both")
    assert decode_candidates([DECODE, PREFILL, both]) == [DECODE, both]
    assert prefill_pool([DECODE, PREFILL, both]) == [PREFILL]
    assert decode_candidates([PREFILL]) == [PREFILL]  # nothing else runs: whole requests go there


def test_a_short_output_is_served_whole_by_the_prefill_engine():
    """2048 tokens of float32 KV take 0.19 s to pull at 500 MB/s: four 40 ms steps on the prefill
    engine cost less, so nothing is handed over; 128 steps cost more, so it is."""
    prefill = engine("http://p", "prefill", step_ms=40.0)
    d = decide(DECODE, [prefill], request(2048, max_tokens=4), 0.05)
    assert d.reason == "short_output" and d.whole is prefill and not d.disaggregated
    assert d.ttft_s == pytest.approx(2.048)  # the prefill engine's prefill, no transfer
    assert decide(DECODE, [prefill], request(2048, max_tokens=128), 0.05).disaggregated
    assert decide(DECODE, [prefill], request(2048, max_tokens=None), 0.05).disaggregated  # no limit: it may be long
    # Served whole it pays no transfer, so the TTFT rule judges it by the prefill alone: 2.05 s
    # meets a 2.1 s SLO that the hand-off (2.24 s) would miss.
    assert decide(DECODE, [prefill], request(2048, slo=2.1, max_tokens=4), 0.05).reason == "short_output"
    assert decide(DECODE, [prefill], request(2048, slo=2.1, max_tokens=128), 0.05).reason == "ttft"


def test_a_short_output_uses_the_decode_engines_step_when_the_prefill_engine_has_none():
    """A prefill engine that never decoded has no step of its own: the decode engine's (the same
    model) stands in; with neither measured, the request is handed over as before."""
    assert decide(DECODE, [PREFILL], request(2048, max_tokens=4), 0.05).disaggregated  # nothing measured
    measured = engine("http://d", "decode", step_ms=40.0)
    d = decide(measured, [PREFILL], request(2048, max_tokens=4), 0.05)
    assert d.reason == "short_output" and d.whole is PREFILL
    fast_link = engine("http://d", "decode", step_ms=40.0, transfer_bps=10e9)  # 9 ms to pull: hand it over
    assert decide(fast_link, [PREFILL], request(2048, max_tokens=4), 0.05).disaggregated


def test_a_slow_link_does_not_keep_a_long_prompt_with_a_short_output_on_the_decode_engine():
    """At 10 MB/s the 94 MB of a 2,048-token document take 9.4 s to pull: more than the 2 s of
    prefill the decode engine is spared, so a hand-off does not pay (short_prompt). Served whole
    it pulls nothing, so the 2 s it spares the decode engine's streams stand: short_output. (The
    gain once counted the pull against that too, and such a document was prefilled on the decode
    engine, stalling its streams for seconds.)"""
    slow = engine("http://d", "decode", step_ms=40.0, transfer_bps=10e6)
    d = decide(slow, [PREFILL], request(2048, max_tokens=4), 0.05)
    assert d.reason == "short_output" and d.whole is PREFILL and d.gain_s == pytest.approx(2.048)
    assert decide(slow, [PREFILL], request(2048, max_tokens=None), 0.05).reason == "short_prompt"
    assert decide(slow, [PREFILL], request(32, max_tokens=1), 0.05).reason == "short_prompt"  # 32 ms spared


def test_a_decode_engine_that_never_prefilled_is_judged_at_the_prefill_engines_rate_for_the_ttft():
    """A fresh decode engine (no prefill rate of its own) would take a 4,096-token document in
    ~4 s at the prefill engine's 1,000 tok/s, missing a 3 s TTFT as the hand-off does: the
    prefill engine takes it. Unmeasured, colocated serving was predicted to meet any TTFT, and the
    TTFT rule prefilled documents on the decode engine, stalling its streams."""
    fresh = engine("http://d", "decode", rate=0.0)
    d = decide(fresh, [PREFILL], request(4096, slo=3.0), 0.05)
    assert d.disaggregated and d.reason == "disaggregated"
    # A short chat that the prefill engine's queue would make miss the TTFT still stays here.
    busy = engine("http://p", "prefill", waiting=4000)
    assert decide(fresh, [busy], request(256, slo=3.0), 0.05).reason == "ttft"


def test_a_pessimistic_pull_rate_is_tried_again_once_it_is_old():
    """One pull measured while the prefill engine was busy (0.6 MB/s, as in a benchmark run)
    makes a 1,024-token prompt's 47 MB look 79 s away, so such prompts stay colocated and
    nothing measures the rate again. Trusted for 10 s, it counts as twice as fast each 10 s
    after, up to the 500 MB/s assumed before any pull: the prompt is handed over once the
    transfer it predicts fits the gain (1 s spared at 1,000 tok/s), and a fresh measure (age 0)
    is trusted as it is."""
    chat = request(64 * BS)

    def at(age_s: float, trust_s: float = 10.0):
        slow = engine("http://d", "decode", transfer_bps=0.6e6, transfer_age_s=age_s)
        return decide(slow, [PREFILL], chat, 0.05, transfer_trust_s=trust_s)

    assert at(0.0).reason == at(10.0).reason == "short_prompt"  # 79 s to pull
    assert at(60.0).reason == "short_prompt"  # 32x: 2.5 s
    d = at(80.0)  # 128x: 0.61 s, under the 1 s spared
    assert d.disaggregated and d.transfer_s == pytest.approx(64 * BS * KV_BYTES / (0.6e6 * 128))
    assert d.gain_s == pytest.approx(1.024 - d.transfer_s)
    assert at(80.0, trust_s=0.0).reason == "short_prompt"  # 0: trusted for good
    assert pull_rate(engine("http://d", "decode", transfer_bps=0.6e6, transfer_age_s=15.0).load, 10.0) == (
        pytest.approx(0.6e6 * 2**0.5)  # between periods: it grows smoothly
    )


def test_an_old_pull_rate_is_worth_no_more_than_none():
    """However old, a measured rate grows to the 500 MB/s a gateway assumes before any pull, not
    past it (and with no overflow); a rate measured above that is kept, old or not; a rate that
    is not a rate counts as none."""

    def rate(bps: float, age_s: float) -> float:
        return pull_rate(engine("http://d", "decode", transfer_bps=bps, transfer_age_s=age_s).load, 10.0)

    assert rate(0.6e6, 1e9) == pytest.approx(500e6) and rate(0.0, 1e9) == 500e6
    assert rate(2e9, 1e9) == rate(2e9, 0.0) == 2e9
    assert rate(-5.0, 0.0) == rate(float("nan"), 0.0) == 500e6



def test_the_short_output_rule_prices_the_pull_at_the_rate_as_measured():
    """However old, the measured rate decides whether a short output is served whole (aged
    rates had 4-token documents handed over in a benchmark run): 20 tokens take the prefill
    engine 0.8 s, less than the 94 MB pull at the 50 MB/s measured (1.9 s), though more than at
    the 500 MB/s an old measure ages to (0.19 s). The gain rule, for a long output, takes the
    aged rate."""
    stale = engine("http://d", "decode", step_ms=40.0, transfer_bps=50e6, transfer_age_s=1000.0)
    d = decide(stale, [PREFILL], request(2048, max_tokens=20), 0.05, transfer_trust_s=10.0)
    assert d.reason == "short_output" and d.transfer_s == pytest.approx(2048 * KV_BYTES / 50e6)  # the pull avoided
    d = decide(stale, [PREFILL], request(2048, max_tokens=None), 0.05, transfer_trust_s=10.0)
    assert d.disaggregated and d.transfer_s == pytest.approx(2048 * KV_BYTES / 500e6)
