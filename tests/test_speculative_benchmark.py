"""benchmarks/speculative.py's workload runners on a small scale: every configuration writes the
same tokens in float32, and the report has the fields the README quotes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import speculative


@pytest.mark.slow  # SmolLM2 runs, ~10 s
def test_single_stream_and_batched_reports(smollm, capsys):
    llms = {name: speculative.build(smollm, k, 512, "float32") for name, k in speculative.CONFIGS.items()}
    single = speculative.run_workload(llms, speculative.REPETITIVE[:1], max_tokens=24, repeats=1)
    assert set(single) == set(speculative.CONFIGS)
    assert all(row["same_tokens_as_off"] for row in single.values())  # float32: speculation changes no token
    assert single["off"]["speedup"] == 1.0 and single["off"]["acceptance_rate"] is None
    assert single["ngram k=3"]["acceptance_rate"] is not None and single["ngram k=3"]["output_tokens"] > 0
    batched = speculative.run_batched(llms, speculative.OPEN_CHAT[:2], max_tokens=8, total=3)
    assert all(row["output_tokens"] > 0 and row["output_tok_s"] > 0 for row in batched.values())
    speculative.print_table({"repetitive": single})
    assert "ngram k=5" in capsys.readouterr().out
    machine = speculative.report(llms, {"repetitive": single}, {"open chat": batched})["machine"]
    assert machine["cpu_model"] and machine["cores"] >= 1 and "avx2" in machine["isa"]
    assert machine["dtype"] == "float32"  # what the engines resolved, not what was asked for
