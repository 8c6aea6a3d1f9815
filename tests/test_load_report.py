"""The /load contract (common/load_report.py): what the engine builds is what the gateway, the
operator and /metrics read, through one typed module."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from kvharbor.common.load_report import LoadReport, LoadReportError
from kvharbor.engine.core_io import CoreStats
from kvharbor.engine.serve.metrics import ServerMetrics

FULL = LoadReport(
    model="m", instance_id="a", running=3, waiting=2, waiting_prefill_tokens=900, kv_blocks_total=100,
    kv_blocks_free=40, kv_blocks_cached=10, prefill_tokens_per_s=1234.5, decode_step_ms=45.25,
    spec_acceptance_rate=0.5, draining=True, in_flight=5, slo_requests=7, slo_attainment=0.875,
    lora_adapters={"sql": "sql@ab12", "chat": "chat@cd34"}, lora_active=("sql",), lora_slots=2, lora_bytes=4096,
)  # fmt: skip


def test_a_report_round_trips_through_json():
    assert LoadReport.from_json(FULL.to_json()) == FULL
    bare = LoadReport(model="m")
    assert "slo_attainment" not in bare.to_json() and LoadReport.from_json(bare.to_json()) == bare
    assert set(FULL.to_json()) == {f.name for f in dataclasses.fields(LoadReport)}


def test_readers_get_defaults_for_missing_fields_and_ignore_unknown_ones():
    report = LoadReport.from_json({"running": 2, "waiting": 1, "a_field_from_the_future": [1, 2]})
    assert (report.queue, report.kv_free_fraction, report.slo_attainment) == (3, 1.0, None)
    assert LoadReport.from_json({"prefill_tokens_per_s": 7}).prefill_tokens_per_s == 7.0
    assert (report.lora_adapters, report.lora_active, report.lora_free_slots) == ({}, (), 0)
    assert FULL.lora_free_slots == 1


@pytest.mark.parametrize(
    "bad",
    [[], "x", {"running": "3"}, {"running": -1}, {"running": 1.5}, {"draining": "yes"}, {"model": 3},
     {"decode_step_ms": True}, {"slo_attainment": "high"}, {"lora_adapters": ["sql"]},
     {"lora_adapters": {"sql": 1}}, {"lora_active": "sql"}, {"lora_active": [1]}],
)  # fmt: skip
def test_a_malformed_report_is_refused_naming_the_field(bad):
    with pytest.raises(LoadReportError, match="/load"):
        LoadReport.from_json(bad)


def test_an_answer_with_none_of_the_fields_is_not_taken_for_an_idle_engine():
    """vLLM's GET /load answers {"server_load": N}: read as defaults, it was an idle engine of
    block size 0 that the gateway sent everything to (issue 25, #40)."""
    for foreign in ({"server_load": 3}, {}):
        with pytest.raises(LoadReportError, match="none of a load report's fields"):
            LoadReport.from_json(foreign)


def test_metrics_render_the_same_report():
    text = ServerMetrics(lambda: (FULL, CoreStats()), "m", "a").render().decode()
    assert 'kvharbor_requests_running{instance="a",model="m"} 3.0' in text
    assert 'kvharbor_kv_blocks_free{instance="a",model="m"} 40.0' in text
    assert 'kvharbor_decode_step_seconds{instance="a",model="m"} 0.04525' in text


def test_core_stats_cross_the_link_whole_and_the_metrics_read_them():
    board = {"kv_events_published": {"": 7.0}, "kv_store_errors": {"push": 2.0}}
    stats = CoreStats(prefix_queries=40, prefix_hits=30, aborted=2, spec_verifications=4, spec_proposed=12,
                      spec_accepted=9, lora_swaps=1, lora_swap_seconds=0.5, board=board)  # fmt: skip
    wire = msgpack.unpackb(msgpack.packb(stats.to_wire()))  # as the core link carries it
    assert CoreStats.from_wire(wire) == stats
    text = ServerMetrics(lambda: (FULL, stats), "m", "a").render().decode()
    assert 'kvharbor_prefix_cache_hit_rate{instance="a",model="m"} 0.75' in text
    assert 'kvharbor_requests_aborted_total{instance="a",model="m"} 2.0' in text
    assert 'kvharbor_spec_acceptance_rate{instance="a",model="m"} 0.75' in text
    assert 'kvharbor_kv_events_published_total{instance="a",model="m"} 7.0' in text
    assert 'kvharbor_kv_store_errors_total{instance="a",model="m",op="push"} 2.0' in text


def test_the_engine_fits_how_a_decode_step_grows_and_reports_it_once_measured():
    from kvharbor.engine.engine_stats import MIN_DECODE_STEPS, EngineStats

    class Chunk:
        num_tokens, draft, end = 1, False, 100  # every sequence 100 tokens long

    class Plan:
        def __init__(self, n: int) -> None:
            self.chunks = [Chunk()] * n

    stats = EngineStats()
    for n in range(1, MIN_DECODE_STEPS):  # a step of n sequences takes 20 + 2 n ms
        stats.record(Plan(n), (20 + 2 * n) / 1000)
    assert stats.decode_report() == {}  # too few steps to predict from
    for n in (3, 8, 1, 5, 2) * 6:
        stats.record(Plan(n), (20 + 2 * n) / 1000)
    report = LoadReport(**stats.decode_report())
    assert report.decode_ms_per_seq == pytest.approx(2.0, rel=1e-3)
    extrapolated = report.decode_step_ms / 1000 + 0.002 * (10 - report.decode_batch)
    assert report.decode_step_s_at(10) == pytest.approx(extrapolated)
    steady = EngineStats()
    for _ in range(20):
        steady.record(Plan(4), 0.03)
    assert steady.decode_report()["decode_ms_per_seq"] == 0.0  # one batch size: no slope to fit
    assert LoadReport().decode_step_s_at(5) == 0.0  # unmeasured: no evidence either way


def test_the_engine_reports_the_growth_per_context_token_of_its_real_steps():
    from kvharbor.engine.engine_stats import EngineStats

    class Chunk:
        num_tokens, draft = 1, False

        def __init__(self, end: int) -> None:
            self.end = end

    class Plan:
        def __init__(self, n: int, length: int) -> None:
            self.chunks = [Chunk(length)] * n

    stats = EngineStats()
    for n, length in zip((3, 8, 1, 5, 2, 6) * 6, (900, 100, 400, 250, 1200, 60) * 6, strict=True):
        stats.record(Plan(n, length), 0.020 + 0.002 * n + 5e-6 * n * length)  # 5 us a context token
    report = LoadReport(**stats.decode_report())
    assert report.decode_us_per_context_token == pytest.approx(5.0, rel=1e-3)
    assert report.decode_ms_per_seq == pytest.approx(2.0, rel=1e-3)
    assert 0 < report.decode_context_tokens < 8 * 1200


def test_a_decode_step_prediction_counts_the_kv_it_would_read():
    measured = dict(decode_step_ms=40.0, decode_batch=4.0, decode_ms_per_seq=2.0, decode_context_tokens=2000.0,
                    decode_us_per_context_token=5.0)  # fmt: skip
    report = LoadReport(**measured, context_tokens=2400)
    assert report.decode_step_s_at(5) == pytest.approx(0.042)  # context as measured
    assert report.decode_step_s_at(5, 4000) == pytest.approx(0.042 + 0.010)  # 2,000 more tokens: +10 ms
    assert report.decode_step_s_at(5, 0) == pytest.approx(0.032)
    older = LoadReport(decode_step_ms=40.0, decode_batch=4.0, decode_ms_per_seq=2.0)  # an engine without the fit
    assert older.decode_step_s_at(5, 10**6) == pytest.approx(0.042)
    assert LoadReport.from_json(report.to_json()) == report


def test_the_engine_reports_how_old_its_measured_pull_rate_is():
    """The gateway trusts an old pull rate less (gateway/disagg.py pull_rate): the engine says
    how long ago a pull last measured it; 0 before any pull, and each pull starts it again."""
    import time

    from kvharbor.engine.engine_stats import EngineStats

    stats = EngineStats()
    assert stats.kv_transfer_age_s() == 0.0 and stats.kv_transfer_bytes_per_s == 0.0
    stats.record_transfer(3_000_000, 0.02)
    assert stats.kv_transfer_age_s() < 1.0
    stats.kv_transfer_at = time.monotonic() - 42.0  # as if that pull were 42 s ago
    assert stats.kv_transfer_age_s() == pytest.approx(42.0, abs=1.0)
    stats.record_transfer(0, 0.0)  # nothing moved: no measure, so no fresher
    assert stats.kv_transfer_age_s() == pytest.approx(42.0, abs=1.0)
    stats.record_transfer(3_000_000, 0.03)
    assert stats.kv_transfer_age_s() < 1.0 and stats.kv_transfer_bytes_per_s > 0
