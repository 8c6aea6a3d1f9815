"""Graceful drain: SIGTERM lets the in-flight stream finish, refuses new work with 503 and
Retry-After, turns /ready false, and the process exits 0; past --drain-timeout, requests are
aborted and it still exits 0."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from servers import EngineServerProcess

MODEL = "SmolLM2-135M-Instruct"
ARGS = ("--dtype", "bfloat16", "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--log-level", "info")
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a long story."}],
    "max_tokens": 120,
    "ignore_eos": True,
    "stream": True,
    "temperature": 0,
}


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def stream_events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.parametrize(("drain_timeout", "finish"), [(60, "length"), (0.5, "abort")])
def test_sigterm_drains_then_exits_zero(tmp_path, drain_timeout, finish):
    proc = EngineServerProcess(tmp_path, *ARGS, "--drain-timeout", str(drain_timeout)).start()
    try:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", proc.url + "/v1/chat/completions", json=LONG) as stream,
        ):
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            proc.signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(proc.url + "/ready").status_code == 503)
            refused = httpx.post(proc.url + "/v1/chat/completions", json={**LONG, "stream": False})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["code"] == "draining"
            events = stream_events(lines)
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert reasons == [finish]
        assert proc.wait(timeout=60) == 0
        log = proc.log()
        assert '"msg": "drained; stopping"' in log
        # Structured logs: one JSON object per line, with the request id on request lines.
        finished = [json.loads(line) for line in log.splitlines() if '"msg": "finished"' in line]
        assert finished and finished[0]["request_id"].startswith("chatcmpl-")
        assert finished[0]["finish_reasons"] == [finish] and finished[0]["output_tokens"] > 0
    finally:
        proc.stop()
