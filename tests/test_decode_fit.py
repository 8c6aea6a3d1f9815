"""engine/decode_fit.py: the decode step's growth per sequence and per context token, fitted
from steps whose two regressors vary apart, and a clean fallback when they do not."""

from __future__ import annotations

import random

import pytest

from kvharbor.engine.decode_fit import DecodeFit


def step_s(n: int, context: int) -> float:  # 20 ms + 2 ms a sequence + 5 us a context token
    return 0.020 + 0.002 * n + 5e-6 * context


def test_both_slopes_are_recovered_when_batch_and_context_vary_apart():
    rng = random.Random(0)
    fit = DecodeFit()
    for _ in range(60):
        n = rng.randint(1, 16)
        context = n * rng.randint(64, 1024)
        fit.add(n, context, step_s(n, context))
    per_seq, per_token = fit.slopes()
    assert per_seq == pytest.approx(0.002, rel=1e-6) and per_token == pytest.approx(5e-6, rel=1e-6)


def test_a_fixed_batch_over_contexts_of_other_lengths_puts_the_growth_on_the_tokens():
    fit = DecodeFit()
    for i in range(40):  # 8 sequences, short ones and long ones taking turns
        context = 8 * (200 if i % 2 else 1000) + 8 * i
        fit.add(8, context, step_s(8, context))
    assert fit.slopes() == pytest.approx((0.0, 5e-6), rel=1e-6)


def test_a_context_that_only_creeps_gives_no_slope_to_extrapolate():
    fit = DecodeFit()
    for i in range(40):  # 8 sequences, each a token longer every step: a 5% spread
        fit.add(8, 8 * (200 + i), step_s(8, 8 * (200 + i)))
    assert fit.slopes() == (0.0, 0.0)


def test_collinear_or_unvaried_regressors_fall_back_to_the_per_sequence_line():
    together = DecodeFit()
    for n in (1, 4, 8, 2, 6) * 8:  # every sequence 100 tokens long: context is 100 n
        together.add(n, 100 * n, step_s(n, 100 * n))
    per_seq, per_token = together.slopes()
    assert per_token == 0.0 and per_seq == pytest.approx(0.002 + 100 * 5e-6, rel=1e-6)
    steady = DecodeFit()
    for _ in range(20):
        steady.add(4, 800, 0.03)
    assert steady.slopes() == (0.0, 0.0)  # nothing varied: no growth to tell
    assert DecodeFit().slopes() == (0.0, 0.0)


def test_a_negative_joint_slope_keeps_the_line_that_explains_more():
    """Noise gives the per-sequence slope a small negative value next to a real per-token
    growth (a weight-bound GPU step barely grows per row): the per-token line is kept."""
    rng = random.Random(1)
    fit = DecodeFit()
    for _ in range(60):
        n = rng.randint(1, 16)
        context = rng.randint(500, 20_000)
        fit.add(n, context, 0.020 - 0.0001 * n + 5e-6 * context)
    per_seq, per_token = fit.slopes()
    assert per_seq == 0.0 and per_token == pytest.approx(5e-6, rel=0.1)


def test_a_falling_slope_is_not_reported():
    fit = DecodeFit()
    for n in (1, 2, 3, 4, 5) * 6:  # noise that makes bigger batches look faster
        fit.add(n, 500, 0.05 - 0.001 * n)
    assert fit.slopes() == (0.0, 0.0)
