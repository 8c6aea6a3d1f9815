"""The load test end to end, briefly: `loadtest/run.py` starts the platform, runs the personas for
~15 s, writes Locust's files, the summary and the plot, exits 0 under loose SLOs; judged again
under an impossible SLO it exits 1 and names it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

RUN = Path(__file__).resolve().parent.parent / "loadtest" / "run.py"


def test_loadtest_smoke_run_and_slo_verdicts(tmp_path):
    loose = tmp_path / "loose.yaml"
    loose.write_text(
        yaml.safe_dump(
            {"tenants": {t: {"ttft_p95_ms": 600000, "max_error_rate": 1.0} for t in ("chat", "docqa", "batch")}}
        )
    )
    out = tmp_path / "run"
    args = [
        "--engines",
        "1",
        "--users",
        "3",
        "--spawn-rate",
        "3",
        "--run-time",
        "15s",
        "--slos",
        str(loose),
        "--out",
        str(out),
    ]
    done = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("locust_stats.csv", "locust.html", "requests.jsonl", "summary.json", "report.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert sum(s["ok"] for s in summary.values()) > 0
    assert "TTFT" in (out / "locust_stats.csv").read_text()  # the custom metrics reach Locust's own report

    impossible = tmp_path / "impossible.yaml"
    impossible.write_text(yaml.safe_dump({"tenants": {"chat": {"ttft_p95_ms": 0.001}}}))
    judged = subprocess.run([sys.executable, str(RUN), "--report-only", str(out), "--slos", str(impossible)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert judged.returncode == 1
    assert "chat: TTFT p95" in judged.stdout and "> 0.001 ms" in judged.stdout
