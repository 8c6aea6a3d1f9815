"""Issue 17's burst through the gateway's app (in-process over httpx's ASGI transport, fake engines
behind httpx.MockTransport): concurrent same-prefix chats, all routed before any engine answers
and with no /load poll in between, so only the gateway's own count of what it sent can spread them.
Measured before that count existed: 7 of 8 such requests went to the engine holding the prefix."""

from __future__ import annotations

import asyncio
import json

import httpx
from gateway_state import gateway_state, polled_pool

from kvharbor.gateway.app import build_app
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.tenants import hash_key

MODEL = "burst-m"
PROMPT = [(i * 7) % 900 + 1 for i in range(512)]  # 32 full blocks of 16
BURST = 20
TENANTS = {"tenants": [{"name": "acme", "api_keys": [hash_key("sk-acme")]}]}
# Both engines idle, and alike: 1,000 prefill tokens/s, a 20 ms decode step growing 2 ms a sequence.
IDLE = {"prefill_tokens_per_s": 1000.0, "decode_step_ms": 20.0, "decode_batch": 1.0, "decode_ms_per_seq": 2.0}


class HeldIndex:
    """A holds 30 of the prompt's 32 blocks, B none: the burst itself is not indexed yet."""

    async def lookup(self, model, hashes, ids):
        return {"A": 30}

    async def close(self) -> None:
        pass


class GatedEngines:
    """Each request waits until the whole burst has arrived (or 10 s), so every routing decision
    is made while all earlier requests are still in flight; records the engine of each, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.all_in = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.order.append(request.url.host.upper())
        if len(self.order) == BURST:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 10)
        body = json.loads(request.content)
        usage = {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": 1, "total_tokens": 513}
        chunks = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [], "usage": usage}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def test_a_burst_of_one_prefix_through_the_app_spreads_once_the_holder_is_predicted_slower():
    async def main():
        fake = GatedEngines()
        http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        pool = polled_pool(http, MODEL, ["http://a", "http://b"], lambda url: IDLE)
        state = gateway_state(http, pool, {MODEL: None}, TENANTS, HeldIndex())
        state.admission.max_queue = BURST
        state.router.config = RoutingConfig(imbalance_threshold=100)  # the predictions decide, not the queue gap
        transport = httpx.ASGITransport(app=build_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as client:
                body = {"model": MODEL, "prompt_token_ids": PROMPT, "max_tokens": 1, "stream": True}
                headers = {"Authorization": "Bearer sk-acme"}
                replies = await asyncio.gather(
                    *(client.post("/v1/completions", json=body, headers=headers) for _ in range(BURST))
                )
        finally:
            await http.aclose()
        return fake.order, replies

    order, replies = asyncio.run(main())
    assert all(r.status_code == 200 and "[DONE]" in r.text for r in replies), [r.text for r in replies]
    assert len(order) == BURST
    # The arithmetic of tests/test_gateway_units.py's burst: on A, request k (from 0) waits behind
    # k tails of 32 tokens and its own, 32 x (k + 1) ms, against B's whole 512-token miss; A keeps
    # the first 15, then both take the rest.
    first_b = order.index("B")
    assert order[:first_b] == ["A"] * 15 == order[:15]
    assert {"A", "B"} == set(order[first_b:])
