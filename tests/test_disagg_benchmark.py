"""benchmarks/disagg.py's report, from a result shaped as a run writes it (a real run starts
SmolLM2 engines for minutes: `python benchmarks/disagg.py`): the table, the plot, and its
argument checks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def disagg():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import disagg

    return disagg


def setup_result(itl_p99: float) -> dict:
    keys = ["chat_itl_p50_ms", "chat_itl_p95_ms", "chat_itl_p999_ms", "chat_itl_max_ms", "chat_ttft_p50_ms",
            "chat_ttft_p95_ms", "doc_ttft_p50_ms", "doc_ttft_p95_ms", "output_tok_s", "chat_goodput_rps",
            "doc_goodput_rps", "kv_bytes_moved", "errors"]  # fmt: skip
    return {k: 1.0 for k in keys} | {"chat_itl_p99_ms": itl_p99}


def test_the_report_has_a_table_and_a_plot_per_load(disagg, tmp_path, capsys):
    loads = [{"doc_rate": rate, "docs": docs, "setups": {"colocated": setup_result(c), "pd": setup_result(p)},
              "itl_p99_ratio": c / p, "throughput_ratio": 1.0}
             for rate, docs, c, p in ((0.045, 9, 85.0, 74.0), (0.08, 16, 3153.0, 91.0))]  # fmt: skip
    result = {"title": "a CPU", "loads": loads}
    disagg.plot(result, tmp_path / "d.png")
    disagg.print_table(result)
    out = capsys.readouterr().out
    assert (tmp_path / "d.png").stat().st_size > 10_000
    assert "9 documents at 0.045/s" in out and "16 documents at 0.08/s" in out
    assert "1.15x (target >= 2x)" in out and "34.65x (target >= 2x)" in out


def test_document_rates_are_checked_and_set_how_many_documents_arrive(disagg):
    assert disagg.rates("0.045,0.08") == [0.045, 0.08]
    for bad in ("fast", "0.1,", "0,0.1", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            disagg.rates(bad)
    args = argparse.Namespace(chats=40, chat_rate=0.2)
    assert [disagg.docs_at(args, r) for r in (0.045, 0.08, 0.001)] == [9, 16, 1]
