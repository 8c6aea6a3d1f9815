"""The engine's SLO attainment window (/load's slo_attainment, the operator's `slo` metric)."""

from __future__ import annotations

import pytest

from kvharbor.engine.serve.slo_window import SLOWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_attainment_counts_ttft_and_mean_itl_over_the_window():
    clock = Clock()
    slo = SLOWindow(ttft_s=1.0, itl_s=0.1, window_s=60, clock=clock)
    assert slo.attainment() == (None, 0)
    slo.record(0.0, [0.5, 0.55, 0.6])  # met
    slo.record(0.0, [1.5, 1.55])  # TTFT missed
    slo.record(0.0, [0.2, 0.2, 0.25, 0.9])  # mean ITL (0.7 / 3) missed, though most gaps are small
    slo.record(0.0, [0.9, 1.0, 1.3])  # mean ITL 0.2 missed
    slo.record(0.0, [])  # produced nothing: a miss
    slo.record(0.0, [1.0])  # a single token at exactly the target: met
    assert slo.attainment() == (2 / 6, 6)
    clock.now += 61
    slo.record(0.0, [0.1])
    assert slo.attainment() == (1.0, 1)  # the old ones left the window
    clock.now += 61
    assert slo.attainment() == (None, 0)


def test_targets_must_be_positive():
    with pytest.raises(ValueError):
        SLOWindow(0, 0.1)
