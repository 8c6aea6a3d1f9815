"""Graceful drain: SIGTERM lets the in-flight stream finish, refuses new work with 503 and
Retry-After, turns /ready false, and the process exits 0; past --drain-timeout, requests are
aborted and it still exits 0."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx
import pytest
from servers import EngineServerProcess

pytestmark = pytest.mark.slow  # a real `kvharbor serve` per test

MODEL = "tiny-chat"  # drain is the point here, not SmolLM2's weights: the tiny model starts in seconds
ARGS = ("--dtype", "float32", "--num-kv-blocks", "180", "--max-model-len", "2048", "--log-level", "info")
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a long story."}],
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


# The stream must outlive the checks after SIGTERM (~1 s), and outlive the 0.5 s drain timeout by
# far: the tiny model decodes one request at a few ms a token here, and can be told to stop after
# max_model_len - prompt tokens at most (the length case) or to run to the 2048-token limit (a
# 512-token limit was seen to finish within the checks and the 0.5 s on a fast AMD EPYC).
@pytest.mark.parametrize(("drain_timeout", "max_tokens", "finish"), [(60, 400, "length"), (0.5, None, "abort")])
def test_sigterm_drains_then_exits_zero(tmp_path, tiny_chat_model, drain_timeout, max_tokens, finish):
    proc = EngineServerProcess(tmp_path, "--model", str(tiny_chat_model), *ARGS, "--drain-timeout", str(drain_timeout))
    proc.start()
    body = {**LONG, "max_tokens": max_tokens}
    try:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", proc.url + "/v1/chat/completions", json=body) as stream,
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
        (draining,) = [json.loads(line) for line in log.splitlines() if '"msg": "draining"' in line]
        assert draining["in_flight"] == 1  # the stream was still running when the drain began
        # Structured logs: one JSON object per line, with the request id on request lines.
        finished = [json.loads(line) for line in log.splitlines() if '"msg": "finished"' in line]
        assert finished and finished[0]["request_id"].startswith("chatcmpl-")
        assert finished[0]["finish_reasons"] == [finish] and finished[0]["output_tokens"] > 0
    finally:
        proc.stop()


def test_sigterm_to_the_process_group_drains_every_stream_and_exits_zero(tmp_path, tiny_chat_model):
    # systemd's default KillMode, dumb-init and a terminal's job control signal the whole group:
    # the engine core must leave SIGTERM to the API server, which drains and then stops it.
    proc = EngineServerProcess(tmp_path, "--model", str(tiny_chat_model), *ARGS, "--drain-timeout", "60",
                               own_group=True)  # fmt: skip
    proc.start()
    body = {**LONG, "max_tokens": 300}
    try:
        with httpx.Client(timeout=120) as http, contextlib.ExitStack() as streams:
            opened = [streams.enter_context(http.stream("POST", proc.url + "/v1/chat/completions", json=body))
                      for _ in range(3)]  # fmt: skip
            lines = [s.iter_lines() for s in opened]
            for it in lines:
                next(line for line in it if line.startswith("data: {"))  # every stream is running
            proc.signal_group(signal.SIGTERM)
            reasons = [[c["finish_reason"] for e in stream_events(it) for c in e["choices"] if c["finish_reason"]]
                       for it in lines]  # fmt: skip
        assert reasons == [["length"]] * 3
        assert proc.wait(timeout=60) == 0
        assert '"msg": "drained; stopping"' in proc.log()
    finally:
        proc.stop()
