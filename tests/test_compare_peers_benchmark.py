"""benchmarks/compare_peers.py: ratios over several rounds are each case's median with its range,
and bad arguments are refused before any server starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare_peers


def case(prefix: int, conc: int, tok: float, ttft: float, itl: float) -> dict:
    return {"shared_prefix": prefix, "concurrency": conc, "output_tok_s_ratio": tok, "ttft_p50_ratio": ttft,
            "itl_mean_ratio": itl}  # fmt: skip


def test_the_ratios_are_each_cases_median_over_the_rounds_with_their_range():
    rounds = [
        [case(0, 1, 1.8, 0.8, 0.5), case(0, 8, 1.6, 0.6, 0.7)],
        [case(0, 1, 1.5, 1.0, 0.6), case(0, 8, 1.3, 0.5, 0.8)],
        [case(0, 1, 1.6, 0.7, 0.55), case(0, 8, 2.0, 0.55, 0.75)],
    ]
    got = compare_peers.median_ratios(rounds)
    assert [(r["shared_prefix"], r["concurrency"], r["rounds"]) for r in got] == [(0, 1, 3), (0, 8, 3)]
    assert got[0]["output_tok_s_ratio"] == 1.6 and got[0]["output_tok_s_ratio_range"] == [1.5, 1.8]
    assert got[0]["ttft_p50_ratio"] == 0.8 and got[1]["ttft_p50_ratio_range"] == [0.5, 0.6]
    assert got[1]["itl_mean_ratio"] == 0.75
    one = compare_peers.median_ratios(rounds[:1])  # one round: its own ratios, a range of one value
    assert one[1]["output_tok_s_ratio"] == 1.6 and one[1]["output_tok_s_ratio_range"] == [1.6, 1.6]


def test_rounds_of_different_cases_are_refused():
    with pytest.raises(ValueError):
        compare_peers.median_ratios([[case(0, 1, 1, 1, 1)], [case(0, 1, 1, 1, 1), case(0, 8, 1, 1, 1)]])


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--vllm-python", "python"], ["--outp", "x.json"],
                                  ["--dtype", "float16"]])  # fmt: skip
def test_bad_arguments_are_refused(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["compare_peers.py", *argv])
    with pytest.raises(SystemExit):
        compare_peers.main()
    assert "error" in capsys.readouterr().err
