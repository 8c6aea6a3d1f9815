"""P/D through real processes: a prefill engine and a decode engine (SmolLM2, float32), a real
redis-server and the gateway, driven by the `openai` client. The tokens equal one engine's, the
decode engine computes only the prompt's tail, pinned blocks are released on confirmation or at
the lease's end, and a damaged block or a dead prefill engine costs a recompute, never the answer."""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
import openai
import pytest
from servers import (
    EngineServerProcess,
    GatewayProcess,
    OTLPCollector,
    RedisProcess,
    metric,
    start_together,
    wait_for,
    write_tenants,
)

pytestmark = pytest.mark.slow  # real engines, redis-server and a gateway

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "4096")
LEASE_S = 3
FAST_SPANS = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. " + "Answer briefly and exactly. " * 20},
    {"role": "user", "content": "Name three rivers of Europe and the seas they reach."},
]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg")
    write_tenants(logs / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    with OTLPCollector() as otlp, RedisProcess(logs / "redis") as rds:
        traced = ("--otlp-endpoint", otlp.url)
        prefill = EngineServerProcess(logs, "--role", "prefill", "--kv-handoff-lease", str(LEASE_S), "--instance-id",
                                      "P", *traced, *ENGINE_ARGS, env=FAST_SPANS)  # fmt: skip
        decode = EngineServerProcess(logs, "--role", "decode", "--instance-id", "D", *traced, *ENGINE_ARGS,
                                     env=FAST_SPANS)  # fmt: skip
        procs = [prefill, decode]
        try:
            start_together(procs)
            gateway = GatewayProcess(
                logs, "--engines", f"{prefill.url},{decode.url}", "--tenants-file", str(logs / "tenants.yaml"),
                "--redis-url", rds.url, "--pd-min-gain-ms", "0", *traced, env=FAST_SPANS,
            )  # fmt: skip
            procs.append(gateway)
            gateway.start()
            wait_for(lambda: httpx.get(gateway.url + "/ready").status_code == 200, what="gateway sees engines")
            yield {"prefill": prefill, "decode": decode, "gateway": gateway, "otlp": otlp}
        finally:
            for p in reversed(procs):
                p.stop()


def engine_chat(engine, max_tokens: int = 24, **extra) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def metrics(proc) -> str:
    return httpx.get(proc.admin_url + "/metrics").text


def load(proc) -> dict:
    return httpx.get(proc.url + "/load").json()


def test_a_chat_through_prefill_and_decode_engines_equals_one_engines(pd):
    ref = engine_chat(pd["prefill"])  # the prefill engine, serving the whole request
    want = ref["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=pd["gateway"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-request-id": "pd-trace-1"},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage.completion_tokens == ref["usage"]["completion_tokens"] > 1
    # The decode engine pulled every full block and computed only the tail (and the first token).
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16
    gw, dm, pm = metrics(pd["gateway"]), metrics(pd["decode"]), metrics(pd["prefill"])
    assert metric(gw, "kvharbor_gateway_pd_decisions_total", 'reason="disaggregated"') == 1
    assert metric(dm, "kvharbor_kv_handoff_pulls_total", 'result="ok"') == 1
    assert metric(dm, "kvharbor_kv_handoff_pulled_blocks_total") == usage.prompt_tokens // 16
    assert metric(dm, "kvharbor_kv_handoff_pulled_bytes_total") > 0
    assert metric(dm, "kvharbor_kv_handoff_pull_seconds_total") > 0
    assert metric(pm, "kvharbor_kv_handoff_sent_blocks_total") == usage.prompt_tokens // 16
    assert load(pd["prefill"])["kv_pinned_blocks"] == 0  # released on the decode engine's confirmation
    assert load(pd["decode"])["kv_transfer_bytes_per_s"] > 0 and load(pd["prefill"])["role"] == "prefill"
    assert 0 <= load(pd["decode"])["kv_transfer_age_s"] < 120  # how old that measure is (gateway/disagg.py pull_rate)
    # One trace: the gateway's span, its prefill call's span, and both engines' spans.
    # Each process exports its spans in the background: wait for both engines' (4 spans could be
    # the gateway's and P's alone, which made this flaky).
    def of_both_engines():
        s = trace_spans(pd["otlp"], "pd-trace-1")
        return {x["attributes"].get("kvharbor.instance_id") for x in s} >= {"P", "D"} and s

    spans = wait_for(of_both_engines, 20, "spans of both engines")
    assert len({s["trace_id"] for s in spans}) == 1
    engines = {s["attributes"]["kvharbor.instance_id"] for s in spans if "kvharbor.instance_id" in s["attributes"]}
    assert engines == {"P", "D"} and "gateway prefill" in {s["name"] for s in spans if s["service"] == "gateway"}


def trace_spans(otlp, rid: str) -> list[dict]:
    """The spans of the trace whose gateway span carries request id `rid`."""
    roots = [s for s in otlp.spans if s["attributes"].get("kvharbor.request_id") == rid]
    return [s for s in otlp.spans if roots and s["trace_id"] == roots[0]["trace_id"]]


def test_an_unconfirmed_hand_off_is_released_when_its_lease_ends(pd):
    out = engine_chat(pd["prefill"], kv_transfer_params={"do_remote_decode": True})
    transfer = out["kv_transfer_params"]
    assert transfer["remote_port"] == load(pd["prefill"])["kv_transfer_port"] > 0
    assert out["usage"]["completion_tokens"] == 1 and transfer["first_token_id"] >= 0
    assert load(pd["prefill"])["kv_pinned_blocks"] > 0
    wait_for(lambda: load(pd["prefill"])["kv_pinned_blocks"] == 0, timeout=LEASE_S + 5, what="the lease to end")


def test_bad_transfer_params_are_refused_by_role(pd):
    cont = {"remote_host": "127.0.0.1", "remote_port": 1, "remote_handle": "x", "first_token_id": 3}
    for engine, params, match in (
        (pd["decode"], {"do_remote_decode": True}, "hands off no KV"),
        (pd["prefill"], cont, "role prefill"),
        (pd["decode"], {"remote_handle": "x"}, "needs remote_host"),
    ):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "kv_transfer_params": params}
        resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code in (400, 422) and match in resp.text, resp.text


class HandoffProxy:
    """A TCP proxy to the prefill engine's hand-off port that, `at` bytes into what it sends back,
    either flips that byte (no `cut`: inside the first block's payload at the default) or calls
    `cut()` and forwards nothing more, so the decode engine sees the transfer end mid-stream."""

    def __init__(self, port: int, at: int = 5000, cut=None) -> None:
        self.target, self.at, self.cut = port, at, cut
        self.cut_at: int | None = None  # bytes forwarded when the cut came
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src, dst, back: bool) -> None:
            seen = 0
            while data := await src.read(65536):
                if back and seen <= self.at < seen + len(data):
                    data = bytearray(data)
                    if self.cut is not None:
                        dst.write(bytes(data[: self.at - seen]))
                        await dst.drain()
                        self.cut_at = self.at
                        await asyncio.to_thread(self.cut)
                        break
                    data[self.at - seen] ^= 0xFF
                seen += len(data)
                dst.write(bytes(data))
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True), return_exceptions=True)

    def __enter__(self) -> HandoffProxy:
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def fresh_body(topic: str) -> dict:
    """A chat no engine has seen any block of (its system prompt is its own)."""
    system = f"You answer questions about {topic}. " + "Be brief and exact. " * 20
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Name three {topic}."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}


def post(engine, body: dict) -> dict:
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def text(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def test_a_short_output_is_served_by_the_prefill_engine_and_nothing_is_handed_over(pd):
    """A ~2,400-token document and one output token: its ~110 MB of float32 KV would take the
    decode engine longer to pull than the prefill engine's one decode step, so the prefill engine
    serves it whole (gateway/disagg.py, short_output)."""
    body = fresh_body("tides")
    body["messages"][0]["content"] += "The tide rose over the harbor wall and fell back again. " * 200
    # Under acme's salt (gateway/tenants.py), so the gateway's requests find the document cached
    # there and the prefill engine computes its ~2,400 tokens once (6.5 s here), not twice.
    salted = {**body, "cache_salt": "tenant:acme"}
    assert text(post(pd["prefill"], salted))  # the prefill engine has measured decode steps now
    wait_for(lambda: load(pd["prefill"])["decode_step_ms"] > 0, what="a measured decode step")
    want = text(post(pd["prefill"], {**salted, "max_tokens": 1}))
    client = openai.OpenAI(base_url=pd["gateway"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)

    def decided(reason: str) -> float:
        return metric(metrics(pd["gateway"]), "kvharbor_gateway_pd_decisions_total", f'reason="{reason}"')

    def decode_engine() -> tuple[float, float]:  # KV it pulled, chats it answered
        m = metrics(pd["decode"])
        chats = metric(m, "kvharbor_requests_total", 'endpoint="/v1/chat/completions",status="200"')
        return metric(m, "kvharbor_kv_handoff_pulled_bytes_total"), chats

    def served_whole() -> bool:
        """One request; True when it went whole to the prefill engine (the gateway polls /load every
        0.5 s: until it has seen the measured step, requests are handed over as before)."""
        whole, before = decided("short_output"), decode_engine()
        out = client.chat.completions.create(**{**body, "max_tokens": 1})
        assert out.choices[0].message.content == want
        if decided("short_output") == whole:
            return False
        assert decode_engine() == before  # no KV moved, and the decode engine never saw the request
        return True

    wait_for(served_whole, timeout=30, what="a short_output decision")


def test_a_damaged_block_is_refused_and_recomputed(pd):
    body = fresh_body("rivers of Asia")
    want = text(post(pd["prefill"], body))
    prefilled = post(pd["prefill"], {**body, "kv_transfer_params": {"do_remote_decode": True}})
    refused = metric(metrics(pd["decode"]), "kvharbor_kv_handoff_pulls_total", 'result="refused"')
    with HandoffProxy(load(pd["prefill"])["kv_transfer_port"]) as proxy:
        params = {**prefilled["kv_transfer_params"], "remote_port": proxy.port}
        got = post(pd["decode"], {**body, "kv_transfer_params": params})
    assert text(got) == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing of the damaged run was used
    assert metric(metrics(pd["decode"]), "kvharbor_kv_handoff_pulls_total", 'result="refused"') == refused + 1
    assert load(pd["prefill"])["kv_pinned_blocks"] == 0  # the decode engine still confirmed


def test_a_prefill_engine_killed_mid_transfer_costs_a_recompute_not_the_answer(pd):
    """Last in the module: it kills the prefill engine, in the middle of its hand-off (the proxy
    has passed on the first block and part of the second, ~737 KB a block in float32)."""
    body = fresh_body("rivers of Africa")
    want = text(post(pd["prefill"], body))
    prefilled = post(pd["prefill"], {**body, "kv_transfer_params": {"do_remote_decode": True}})

    def kill() -> None:
        pd["prefill"].signal(signal.SIGKILL)
        pd["prefill"].wait(30)

    with HandoffProxy(load(pd["prefill"])["kv_transfer_port"], at=1_000_000, cut=kill) as proxy:
        params = {**prefilled["kv_transfer_params"], "remote_port": proxy.port}
        got = post(pd["decode"], {**body, "kv_transfer_params": params})
    assert proxy.cut_at == 1_000_000 and pd["prefill"].proc.poll() is not None  # killed mid-stream
    assert text(got) == want and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(metrics(pd["decode"]), "kvharbor_kv_handoff_pulls_total", 'result="unreachable"') == 1
    # Through the gateway: the prefill pool is down (or its call fails), so the request is colocated.
    body = fresh_body("rivers of America")
    client = openai.OpenAI(base_url=pd["gateway"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
    out = client.chat.completions.create(**body)
    assert out.choices[0].message.content == text(post(pd["decode"], body))
    gw = metrics(pd["gateway"])
    fallbacks = sum(metric(gw, "kvharbor_gateway_pd_decisions_total", f'reason="{r}"')
                    for r in ("prefill_failed", "prefill_down"))  # fmt: skip
    assert fallbacks == 1
