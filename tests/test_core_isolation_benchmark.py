"""benchmarks/core_isolation.py end to end on a small scale: the tiny chat model, a few requests,
a short flood; the report has both phases, the flood's rate and the machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.slow  # a real `kvharbor serve` and a flooding process
def test_quiet_and_flooded_phases_are_measured_and_reported(tmp_path, tiny_chat_model):
    import core_isolation

    out = tmp_path / "iso.json"
    args = ["--model", str(tiny_chat_model), "--requests", "4", "--concurrency", "2", "--output-len", "16",
            "--pollers", "2", "--idle", "4", "--out", str(out)]  # fmt: skip
    assert core_isolation.main(args) == 0
    result = json.loads(out.read_text())
    for phase in ("quiet", "flooded"):
        assert result[phase]["errors"] == 0 and result[phase]["core_decode_step_ms"] > 0
    assert result["flooded"]["polls_per_s"] > 0
    assert set(result["flooded_vs_quiet"]) == {"core_decode_step", "itl_mean", "output_tok_s"}
    assert result["machine"]["dtype"] == "float32" and "avx2" in result["machine"]["isa"]
    assert out.with_suffix(".png").stat().st_size > 0
