"""benchmarks/dtype_auto.py's own parts: its arguments and the verdict it reaches from figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import dtype_auto

from kvharbor.common.machine import CpuInfo

ZEN4 = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}), 2)
AVX2 = CpuInfo("AMD EPYC 7551", "x86_64", frozenset({"avx2", "fma"}), 2)


def figures(decode: float, prefill_ms: float) -> dict:
    return {"decode_c1": decode, "decode_c8": 4 * decode, "prefill_128_ms": prefill_ms,
            "prefill_512_ms": 4 * prefill_ms}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--weights", "none,fp4"], "--weights takes"), (["--weights", ","], "--weights takes"),
     (["--rounds", "0"], "must be >= 1")],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        dtype_auto.main(argv)
    assert match in capsys.readouterr().err


def test_bfloat16_wins_only_where_it_decodes_faster_and_prefills_no_more_than_10_percent_slower():
    f32 = figures(40.0, 200.0)
    row = dtype_auto.verdict("none", f32, figures(80.0, 215.0), ZEN4)
    ratios = row["bf16_over_f32"]
    assert ratios["decode_c1"] == 2.0 and ratios["prefill_128_ms"] == pytest.approx(200 / 215)
    assert (row["faster"], row["auto_picks"], row["rule_holds"]) == ("bfloat16", "bfloat16", True)
    slow_prefill = dtype_auto.verdict("none", f32, figures(80.0, 230.0), ZEN4)
    assert slow_prefill["faster"] == "float32" and not slow_prefill["rule_holds"]  # the rule would be wrong here
    quantized = dtype_auto.verdict("gguf", f32, figures(20.0, 200.0), ZEN4)
    assert (quantized["faster"], quantized["auto_picks"], quantized["rule_holds"]) == ("float32", "float32", True)
    emulated = dtype_auto.verdict("none", f32, figures(30.0, 400.0), AVX2)
    assert emulated["auto_picks"] == "float32" and emulated["rule_holds"]
