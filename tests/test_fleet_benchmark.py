"""benchmarks/fleet.py runs end to end on small sizes, on one redis-server and on a 3-master
Redis Cluster, with its intake replicas in their own processes, and writes its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # real redis-servers and replica processes
def test_fleet_benchmark_writes_json_and_png(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fleet

    out = tmp_path / "fleet.json"
    args = ["--engines", "8", "--blocks-per-engine", "300", "--lookups", "20", "--intake-events", "3000",
            "--out", str(out)]  # fmt: skip
    assert fleet.main(args) == 0
    result = json.loads(out.read_text())
    for kind in ("single", "cluster"):
        runs = result["backends"][kind]
        assert [r["engines"] for r in runs] == [8]
        for run in runs:
            index = run["index"]
            assert index["entries"] == run["engines"] * 300
            assert 0 < index["lookup_held"]["p50_ms"] <= index["lookup_held"]["p99_ms"]
            assert list(index["lookup_by_blocks"]) == [str(b) for b in fleet.PROMPT_LENGTHS]
            assert all(g["p50_ms"] > 0 for g in index["lookup_by_blocks"].values())
            assert index["bytes_per_entry"] > 0 and index["sweep"]["swept"] == index["sweep"]["lapsed"] >= 1
            for replicas in ("1", "2"):
                intake = run["intake"][replicas]
                assert intake["events"] == 3000 and intake["events_per_s"] > 0
                # Between them the replicas owned each stream once and consumed each event once.
                assert len(intake["workers"]) == int(replicas)
                assert sum(w["events"] for w in intake["workers"]) == 3000
                assert sum(w["streams"] for w in intake["workers"]) == run["engines"]
    assert any("lookup p99" in line for line in result["verdict"])
    assert any("1,024 / 256 blocks" in line for line in result["verdict"])
    assert all(result["round_trip_us"][kind] > 0 for kind in ("single", "cluster"))
    assert result["machine"]["cpu_model"] and out.with_suffix(".png").stat().st_size > 0


def test_the_workload_is_prefix_heavy_and_reproducible():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fleet

    a, b = fleet.Fleet(50, 400, seed=3), fleet.Fleet(50, 400, seed=3)
    assert a.blocks_of("engine-0007") == b.blocks_of("engine-0007")
    assert len(a.blocks_of("engine-0007")) == 400 and a.entries == 50 * 400
    shared = {h for p in a.holds["engine-0007"] for h in a.prompts[p]}
    holders = [e for e in a.engines if shared & set(a.blocks_of(e)[: fleet.PROMPTS_PER_ENGINE * fleet.PROMPT_BLOCKS])]
    assert len(holders) > 5  # system prompts are shared across the fleet
    hashes, engine = fleet.prompts_for(a, 1)[0]
    assert len(hashes) == 256 and hashes[: fleet.PROMPT_BLOCKS] == a.prompts[a.holds[engine][0]]
    big = fleet.Fleet(5, 2000)
    long, holder = fleet.prompts_for(big, 1, blocks=1024)[0]
    assert len(long) == 1024 and long[fleet.PROMPT_BLOCKS :] == big.private_chain(holder)[:960]  # all held
