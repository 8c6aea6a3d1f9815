"""The load test end to end, briefly: `loadtest/run.py` starts the platform, runs the personas for
~15 s, writes Locust's files, the summary and the plot, exits 0 under loose SLOs; judged again
under an impossible SLO it exits 1 and names it."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

RUN = Path(__file__).resolve().parent.parent / "loadtest" / "run.py"


@pytest.mark.slow  # a real platform and Locust
def test_loadtest_smoke_run_and_slo_verdicts(tmp_path, tiny_chat_model):
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
        "4s",
        "--model-path",
        str(tiny_chat_model),  # the load test's plumbing is the point here, not SmolLM2's answers
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


class _RefusingGateway(http.server.BaseHTTPRequestHandler):
    """A gateway that knows none of the load test's keys."""

    def do_GET(self):
        body = json.dumps({"error": {"message": "invalid API key", "code": "invalid_api_key"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.slow  # runs loadtest/run.py
def test_unknown_keys_stop_the_run_before_any_load_and_say_how_to_start_the_platform(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RefusingGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host = f"http://127.0.0.1:{server.server_address[1]}"
        done = subprocess.run([sys.executable, str(RUN), "--host", host, "--run-time", "60s", "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused the 'chat' tenant's API key (401)" in done.stderr and "make up" in done.stderr
    assert "SLOs missed" not in done.stdout and not (tmp_path / "locust.log").exists()  # no load was sent


def test_a_run_whose_requests_were_refused_gets_no_slo_verdict(tmp_path, capsys):
    sys.path.insert(0, str(RUN.parent))
    import run as loadtest_run

    rows = [{"tenant": "chat", "t": 1.0 + i, "ok": False, "status": 401, "ttft_ms": None, "itl_ms": [], "tokens": 0,
             "reason": "invalid_api_key"} for i in range(3)]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert loadtest_run.report(tmp_path, RUN.parent / "slos.yaml") == 2
    err = capsys.readouterr().err
    assert "3 requests were refused with 401" in err and "--loadtest-tenants" in err
