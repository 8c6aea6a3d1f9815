"""benchmarks/kvindex.py runs end to end on small sizes (without engines) and writes its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a real redis-server
def test_kvindex_benchmark_writes_json_and_png(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import kvindex

    out = tmp_path / "kvindex.json"
    args = ["--blocks", "256", "--lookups", "5", "--events", "300", "--ttft-reps", "0", "--out", str(out)]
    assert kvindex.main(args) == 0
    result = json.loads(out.read_text())
    for backend in ("memory", "redis"):
        assert 0 < result["lookup"][backend]["p50_ms"] <= result["lookup"][backend]["p99_ms"]
    assert result["intake"]["events"] == 300 and result["intake"]["redis_consumer_events_per_s"] > 0
    assert "ttft" not in result
    machine = result["machine"]
    assert machine["cpu_model"] and machine["cores"] >= 1 and "avx2" in machine["isa"]
    assert "dtype" not in machine  # --ttft-reps 0 runs no engine
    assert out.with_suffix(".png").stat().st_size > 0
