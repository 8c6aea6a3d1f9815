"""Issue 47: no request, however malformed, extreme or combined, may fail, stall or change another
tenant's request. Hypothesis draws hostile requests that combine fields (tests/hostile.py: boundary
and extreme numbers in every numeric field, n, sampling on and off, min_tokens, grammars, tools,
logprobs, stops, long and malformed messages, prompt lists, huge and deep bodies). Each is sent while
three greedy bystander streams decode in the same batches, to a real `kvharbor serve` and through a
real gateway in front of it, and (issue 48) to the gateway's Responses API. Properties:

- every bystander's text equals its text alone (the engine runs batch-invariant, in bfloat16);
- the hostile request gets a 4xx naming a field it sent, or a 200 that keeps its promise;
- never a 5xx, never a hang (every request has a deadline); the servers stay up, and when the
  examples are done the engine holds no request and no KV block.

Bounded: a fixed number of examples per surface, derandomized, so `make test` runs the same cases
every time (KVHARBOR_HOSTILE_EXAMPLES and KVHARBOR_HOSTILE_SEED explore further). The coverage of
each field's values, and what they got, is printed at the end of the session (tests/README.md)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest
import session_report
from hostile import Coverage, Hostile, hostile, judge, responses_sweep, sweep
from hypothesis import HealthCheck, example, given, seed, settings
from servers import EngineServerProcess, GatewayProcess, start_together, wait_for, write_tenants

pytestmark = pytest.mark.slow

MODEL = "tiny-chat"
KEY = "sk-hostile"
EXAMPLES = int(os.environ.get("KVHARBOR_HOSTILE_EXAMPLES", "12"))
SEED = int(os.environ.get("KVHARBOR_HOSTILE_SEED", "47"))
BYSTANDERS = ["Tell me about the sea.", "List three colours.", "What is a cat?"]
BYSTANDER_TOKENS = 32
DEADLINE_S = 60.0  # for any one request: past it, the example fails as a hang
COVERAGE = {"engine": Coverage(), "gateway": Coverage(), "responses": Coverage()}
RESPONSES_EXAMPLES = int(os.environ.get("KVHARBOR_HOSTILE_RESPONSES_EXAMPLES", "4"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_chat_model):
    logs = tmp_path_factory.mktemp("hostile")
    write_tenants(logs / "tenants.yaml", [{"name": "hostile", "key": KEY}])
    model = str(tiny_chat_model)
    engine = EngineServerProcess(logs, "--model", model, "--dtype", "bfloat16", "--batch-invariant", "on",
                                 "--max-model-len", "512", "--num-kv-blocks", "1024", "--log-level", "warning")
    gateway = GatewayProcess(logs, "--engines", engine.url, "--model", model, "--tenants-file",
                             str(logs / "tenants.yaml"), "--log-level", "warning", "--slo-ttft-ms", "60000")
    try:
        start_together([engine])
        gateway.start()
        wait_for(lambda: httpx.get(gateway.url + "/ready", timeout=2).status_code == 200, 60, "the gateway to route")
        yield {"engine": engine, "gateway": gateway}
    finally:
        gateway.stop()
        engine.stop()
        for name, coverage in COVERAGE.items():
            if coverage.examples:
                session_report.add(f"hostile neighbours ({name}): {coverage.examples} examples", coverage.table())


async def bystander(http: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event | None) -> tuple:
    """A greedy chat, streamed: its text and each token's logprob (the same bits, or the batch
    changed it). A repetition penalty keeps the random model's argmax from settling on one token,
    so that any drift in the logits shows in the text. `started` is set at its first token."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": BYSTANDER_TOKENS,
            "temperature": 0, "repetition_penalty": 1.3, "ignore_eos": True, "stream": True,
            "logprobs": True}  # fmt: skip
    text, logprobs = [], []
    async with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=DEADLINE_S) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    logprobs += [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
                if started is not None and logprobs:
                    started.set()
    return "".join(text), logprobs


@pytest.fixture(scope="module")
def alone(servers) -> list[tuple]:
    """Each bystander's text alone on the engine: the reference."""

    async def main() -> list[tuple]:
        async with httpx.AsyncClient() as http:
            return [await bystander(http, servers["engine"].url, p, None) for p in BYSTANDERS]

    return asyncio.run(main())


async def send_beside(url: str, headers: dict, h: Hostile) -> tuple[int, str, list[tuple]]:
    """The hostile request sent once the three bystanders decode; all within DEADLINE_S each."""
    async with httpx.AsyncClient(headers=headers) as http:
        events = [asyncio.Event() for _ in BYSTANDERS]
        streams = [asyncio.create_task(bystander(http, url, p, e)) for p, e in zip(BYSTANDERS, events, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), DEADLINE_S)
        content_type = {"content-type": "application/json"}
        try:
            resp = await http.post(url + h.path, content=h.raw, headers=content_type, timeout=DEADLINE_S)
        except httpx.TimeoutException:
            for s in streams:
                s.cancel()
            raise AssertionError(f"the hostile request got no answer in {DEADLINE_S} s: {h.labels}") from None
        texts = await asyncio.wait_for(asyncio.gather(*streams), DEADLINE_S)
        return resp.status_code, resp.text, texts


def run_examples(surface: str, url: str, headers: dict, health: str, want: list[tuple], half: int) -> None:
    """The sweep's cases of this `half` (every value of every field meets one surface), then
    EXAMPLES combinations Hypothesis draws. Surface "responses": the Responses sweep (every value
    once), then RESPONSES_EXAMPLES drawn."""
    coverage = COVERAGE[surface]
    started = time.monotonic()
    if surface == "responses":
        cases, drawn, kinds = responses_sweep(MODEL, random.Random(SEED)), RESPONSES_EXAMPLES, ("responses",)
    else:
        cases, drawn, kinds = sweep(MODEL, random.Random(SEED))[half::2], EXAMPLES, ("chat", "completion")

    @seed(SEED)
    @settings(max_examples=drawn, deadline=None, derandomize=os.environ.get("KVHARBOR_HOSTILE_SEED") is None,
              database=None, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(h=hostile(MODEL, kinds))
    def one(h: Hostile) -> None:
        status, text, texts = asyncio.run(send_beside(url, headers, h))
        coverage.record(h, status)
        problem = judge(h, status, text)
        assert problem is None, f"{surface}: {h.labels}: {problem}"
        assert texts == want, f"{surface}: a bystander's text changed beside {h.labels}"
        assert httpx.get(url + health, timeout=10).status_code == 200, f"{surface} is down after {h.labels}"

    for case in cases:
        one = example(h=case)(one)
    one()
    spent = time.monotonic() - started
    report = f"{len(cases)} swept and {drawn} drawn examples in {spent:.0f} s"
    session_report.add(f"hostile neighbours ({surface}): time", report)


def test_hostile_requests_beside_bystanders_at_the_engine(servers, alone):
    run_examples("engine", servers["engine"].url, {}, "/health", alone, half=0)


def test_hostile_requests_beside_bystanders_through_the_gateway(servers, alone):
    run_examples("gateway", servers["gateway"].url, {"authorization": f"Bearer {KEY}"}, "/ready", alone, half=1)


def test_hostile_responses_requests_beside_bystanders_through_the_gateway(servers, alone):
    """Issue 48: the Responses API's fields, alone and combined, beside the same bystanders."""
    run_examples("responses", servers["gateway"].url, {"authorization": f"Bearer {KEY}"}, "/ready", alone, half=0)


def test_the_engine_holds_nothing_after_the_hostile_requests(servers):
    def idle() -> bool:
        load = httpx.get(servers["engine"].url + "/load", timeout=5).json()
        return load["running"] == load["waiting"] == load["in_flight"] == 0 and load["kv_blocks_free"] == load[
            "kv_blocks_total"]  # fmt: skip

    wait_for(idle, 30, "the engine to hold no request and no block")
