"""The gateway app's P/D wiring, in-process (httpx's ASGI transport in front of fake engines behind
httpx.MockTransport): what `decide` says is what the engines are sent, and what the metrics count.
The slow e2e tests (test_disagg_e2e.py) run the same paths with real engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re

import httpx
from gateway_state import gateway_state, polled_pool
from servers import metric

from kvharbor.gateway.app import build_app
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.tenants import hash_key

MODEL = "pd-m"
PROMPT = [(i * 11) % 900 + 1 for i in range(900)]  # 56 full blocks of 16, nothing cached anywhere
TENANTS = {"tenants": [{"name": "acme", "api_keys": [hash_key("sk-acme")]}]}
# Both engines measured alike: 1,000 prefill tokens/s and a 40 ms decode step. SmolLM2's float32
# KV (46,080 bytes a token) at the 500 MB/s assumed before a first pull: 56 blocks take 83 ms.
MEASURED = {"prefill_tokens_per_s": 1000.0, "decode_step_ms": 40.0, "decode_batch": 1.0, "kv_bytes_per_token": 46_080}
ROLES = {"http://p": "prefill", "http://d": "decode"}


class FakeEngines:
    """Records each call as (engine letter, payload); a non-streamed call asking for a hand-off gets
    one back, a streamed one a one-token answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.host, body))
        usage = {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": 1, "total_tokens": 901}
        if not body.get("stream"):
            handoff = {"remote_handle": "h1", "remote_port": 1, "remote_block_ids": []}
            answer = {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}], "usage": usage,
                      "kv_transfer_params": handoff}  # fmt: skip
            return httpx.Response(200, json=answer)
        chunks = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [], "usage": usage}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


@contextlib.asynccontextmanager
async def gateway(engines, loads: dict[str, dict], routing: RoutingConfig | None = None, pools: list | None = None):
    """A client of the gateway app in front of `engines` (an httpx.MockTransport handler), whose
    /load answers are `loads` by URL. `pools`: the engine pool is appended to it, for a test to read."""
    http = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    pool = polled_pool(http, MODEL, list(ROLES), lambda url: {**loads[url], "role": ROLES[url]})
    if pools is not None:
        pools.append(pool)
    state = gateway_state(http, pool, {MODEL: None}, TENANTS, routing=routing)
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
            yield client
    finally:
        await http.aclose()


def post(client: httpx.AsyncClient, max_tokens: int):
    body = {"model": MODEL, "prompt_token_ids": PROMPT, "max_tokens": max_tokens, "stream": True}
    return client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-acme"})


def serve(max_tokens: int, decode_load: dict | None = None) -> tuple[list[tuple[str, dict]], str]:
    """One streamed completion of PROMPT through the gateway: the engines' calls and /metrics.
    `decode_load`: fields the decode engine's /load adds to MEASURED."""

    async def main():
        fake = FakeEngines()
        async with gateway(fake, {"http://p": MEASURED, "http://d": {**MEASURED, **(decode_load or {})}}) as client:
            reply = await post(client, max_tokens)
            assert reply.status_code == 200 and "[DONE]" in reply.text, reply.text
            return fake.calls, (await client.get("/metrics")).text

    return asyncio.run(main())


def decided(metrics: str, reason: str) -> float:
    """P/D decisions of `reason` counted in the gateway's /metrics."""
    return metric(metrics, "kvharbor_gateway_pd_decisions_total", f'reason="{reason}"')


def routed(metrics: str) -> dict[str, float]:
    """The routing reasons counted, and how often (those never counted left out)."""
    series = rf'^kvharbor_gateway_routing_decisions_total{{model="{MODEL}",reason="(\w+)"}} (\S+)$'
    return {r: float(n) for r, n in re.findall(series, metrics, re.M) if float(n)}


def test_a_short_output_is_sent_whole_to_the_prefill_engine_and_counted_there(caplog):
    """One token takes the prefill engine 40 ms, less than the 83 ms pull: it serves the request,
    no hand-off is asked for, and the route is counted as short_output, not as the decode engine's.
    The gateway logs the decision with its figures."""
    caplog.set_level(logging.INFO, logger="kvharbor.gateway.api")
    calls, metrics = serve(max_tokens=1)
    logged = [r for r in caplog.records if r.getMessage() == "P/D decision"]
    assert [(r.reason, r.prefill, r.decode, r.gain_ms) for r in logged] == [
        ("short_output", "http://p", "http://d", 900.0)  # 900 tokens at 1,000/s spared, nothing pulled
    ]
    assert [host for host, _ in calls] == ["p"]
    assert calls[0][1]["stream"] is True and "kv_transfer_params" not in calls[0][1]
    assert decided(metrics, "short_output") == 1
    assert routed(metrics) == {"short_output": 1.0}


def test_a_long_output_is_prefilled_on_the_prefill_engine_and_handed_to_the_decode_engine(caplog):
    """64 tokens take the prefill engine 2.6 s: the prompt is prefilled there and its hand-off sent
    to the decode engine, whose route is the one counted. The log gives the predicted pull."""
    caplog.set_level(logging.INFO, logger="kvharbor.gateway.api")
    calls, metrics = serve(max_tokens=64)
    (logged,) = [r for r in caplog.records if r.getMessage() == "P/D decision"]
    assert (logged.reason, logged.transfer_ms, logged.gain_ms) == ("disaggregated", 82.6, 817.4)
    assert [host for host, _ in calls] == ["p", "d"]
    assert calls[0][1]["kv_transfer_params"] == {"do_remote_decode": True} and calls[0][1]["stream"] is False
    assert calls[1][1]["kv_transfer_params"]["remote_handle"] == "h1" and calls[1][1]["stream"] is True
    assert decided(metrics, "disaggregated") == 1
    counted = routed(metrics)
    assert len(counted) == 1 and sum(counted.values()) == 1 and "short_output" not in counted  # the decode route


def test_an_old_pessimistic_pull_rate_is_tried_again_by_the_gateways_default_trust():
    """The decode engine measured 2 MB/s (its 41 MB pull: 20.6 s, against 0.9 s of prefill
    spared; 1,000 tokens would take the prefill engine 40 s, so it is not served whole there):
    fresh, that keeps the prompt colocated; 80 s old, past the gateway's 10 s trust, it counts as
    128 times faster and the prompt is handed over, so its pull measures the rate again."""
    fresh = {"kv_transfer_bytes_per_s": 2e6, "kv_transfer_age_s": 0.0}
    calls, metrics = serve(max_tokens=1000, decode_load=fresh)
    assert [host for host, _ in calls] == ["d"]
    assert decided(metrics, "short_prompt") == 1
    calls, metrics = serve(max_tokens=1000, decode_load={**fresh, "kv_transfer_age_s": 80.0})
    assert [host for host, _ in calls] == ["p", "d"]
    assert decided(metrics, "disaggregated") == 1


def test_a_request_cancelled_while_a_prefill_engine_prefills_it_is_counted_as_routed():
    """The route is counted once P/D has decided; a request cancelled (the gateway shutting down,
    an outer timeout) while its prompt is on the prefill engine was still routed, to the decode
    engine, and counts there, as its P/D decision does."""

    async def main():
        fake, prefilling = FakeEngines(), asyncio.Event()

        async def slow_prefill(request: httpx.Request) -> httpx.Response:
            if not json.loads(request.content).get("stream"):
                prefilling.set()
                await asyncio.sleep(30)  # cancelled long before
            return await fake(request)

        async with gateway(slow_prefill, dict.fromkeys(ROLES, MEASURED)) as client:
            sent = asyncio.create_task(post(client, 64))
            await asyncio.wait_for(prefilling.wait(), 10)
            sent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sent
            return fake.calls, (await client.get("/metrics")).text

    calls, metrics = asyncio.run(main())
    assert calls == []  # the prefill never answered, and nothing reached the decode engine
    counted = routed(metrics)
    assert sum(counted.values()) == 1 and "short_output" not in counted, counted
    assert decided(metrics, "disaggregated") == 1


def test_a_stalled_prefill_engine_is_ejected_and_the_prompt_prefilled_on_the_decode_engine(caplog):
    """A prefill engine that accepts the call and never answers (SIGSTOPped, wedged) held the
    request for the whole request timeout. Past its deadline (the larger of
    --pd-prefill-deadline-s and 4x the predicted TTFT: here 4 x ~0.17 s) the gateway stops waiting,
    counts a failure against that engine (as for a stream that never starts: enough of them eject
    it), and serves the request colocated, counted as prefill_timeout."""
    caplog.set_level(logging.INFO, logger="kvharbor.gateway.api")
    fast_prefill = {**MEASURED, "prefill_tokens_per_s": 10_000.0}  # 900 tokens in 0.09 s there

    async def main():
        fake, pools = FakeEngines(), []

        async def stalled(request: httpx.Request) -> httpx.Response:
            if request.url.host == "p" and not json.loads(request.content).get("stream"):
                await asyncio.sleep(60)  # far past the deadline, and the test's own bound
            return await fake(request)

        routing = RoutingConfig(pd_prefill_deadline_s=0.1)
        async with gateway(stalled, {"http://p": fast_prefill, "http://d": MEASURED}, routing, pools) as client:
            reply = await asyncio.wait_for(post(client, 64), 20)
            assert reply.status_code == 200 and "[DONE]" in reply.text, reply.text
            (prefill_engine,) = [e for e in pools[0].all(MODEL) if e.url == "http://p"]
            return fake.calls, (await client.get("/metrics")).text, prefill_engine

    calls, metrics, prefill_engine = asyncio.run(main())
    assert [host for host, _ in calls] == ["d"]  # the stalled call never answered; d prefilled the prompt
    assert "kv_transfer_params" not in calls[0][1]
    assert decided(metrics, "prefill_timeout") == 1 and decided(metrics, "disaggregated") == 0
    assert prefill_engine.failures == 1 and not prefill_engine.sent  # its call was given up, not left counted
    (stalled_log,) = [r for r in caplog.records if "stalled past its deadline" in r.getMessage()]
    assert 0.1 < stalled_log.deadline_s < 2.0  # 4x the predicted TTFT, above the configured floor


def test_a_prefill_deadline_follows_the_predicted_ttft_and_the_prompt_when_unmeasured():
    from kvharbor.gateway.pd_flow import prefill_deadline

    assert prefill_deadline(10.0, 0.5, 900) == 10.0  # the floor
    assert prefill_deadline(10.0, 5.0, 900) == 20.0  # 4x the predicted TTFT
    # No measured rate (TTFT 0): the prompt at 100 tokens/s, so a long first prompt is no stall.
    assert prefill_deadline(10.0, 0.0, 4096) == 40.96 and prefill_deadline(10.0, 0.0, 300) == 10.0
