"""Multi-LoRA in the gateway (issue 18), without processes: tenant grants, resolving `model` to a
base model and an adapter, /v1/models per tenant, the block hashes under the adapter's identity,
adapter-affinity routing (active > free slot > swap, traded in seconds against prefix and load),
the burst accounting and the per-adapter metrics. The app runs in-process (httpx's ASGI
transport) in front of fake engines (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

import httpx
import pytest
from gateway_state import gateway_state, polled_pool

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.load_report import LoadReport
from kvharbor.common.openai_api import APIError
from kvharbor.gateway.admission import fit_route
from kvharbor.gateway.app import build_app
from kvharbor.gateway.catalog import (
    Resolved,
    adapter_engines,
    adapter_identity_of,
    handoff_peers,
    listed_models,
    resolve,
)
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.engines import Engine, EnginePool
from kvharbor.gateway.predict import LORA_SWAP_S, AdapterSlot, adapter_cost_s, adapter_slot, predict
from kvharbor.gateway.router import Router
from kvharbor.gateway.tenants import Tenant, TenantsError, hash_key, parse_tenants

BASE = "base-m"

# -- tenant grants ---------------------------------------------------------------------------------


def one_tenant(**fields) -> Tenant:
    (tenant,) = parse_tenants({"tenants": [{"name": "acme", "api_keys": [hash_key("k")], **fields}]}).values()
    return tenant


def test_adapters_are_granted_by_name_or_star_and_none_by_default():
    default = one_tenant()
    assert default.adapters == () and not default.may_use_adapter("sql")
    assert default.may_use("anything")  # models stay open by default; adapters do not
    granted = one_tenant(adapters=["sql", "chat-v2.1"])
    assert granted.may_use_adapter("sql") and granted.may_use_adapter("chat-v2.1")
    assert not granted.may_use_adapter("other")
    assert one_tenant(adapters=["*"]).may_use_adapter("anything")
    assert one_tenant(adapters=None).adapters == ()


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ("sql", "adapters must be a list"),
        ({"sql": 1}, "adapters must be a list"),
        (["ok", "has space"], "adapter name 'has space' is not valid"),
        (["a/b"], "adapter name 'a/b' is not valid"),
        ([""], "adapter name '' is not valid"),
        ([3], "adapter name 3 is not valid"),
        (["-leading"], "is not valid"),
        (["x" * 65], "is not valid"),
    ],
)
def test_bad_adapter_grants_are_refused_naming_the_tenant(adapters, message):
    with pytest.raises(TenantsError, match=re.escape(message)) as err:
        one_tenant(adapters=adapters)
    assert str(err.value).startswith("tenant 'acme': adapters")


# -- engines and tenants for the rest --------------------------------------------------------------


def lora_engine(
    url: str,
    adapters: dict[str, str] | None = None,
    active: tuple[str, ...] = (),
    slots: int = 2,
    waiting_tokens: int = 0,
    waiting: int = 0,
) -> Engine:
    """An engine that has measured 1,000 prefill tokens/s and a 20 ms decode step at one sequence
    (2 ms more per sequence), serving `adapters` (name -> identity), `active` in its slots."""
    load = LoadReport(
        model=BASE, instance_id=url[-1].upper(), waiting=waiting, waiting_prefill_tokens=waiting_tokens,
        prefill_tokens_per_s=1000.0, decode_step_ms=20.0, decode_batch=1.0, decode_ms_per_seq=2.0,
        kv_blocks_free=100, kv_blocks_total=100, lora_adapters=adapters or {}, lora_active=active, lora_slots=slots,
    )  # fmt: skip
    e = Engine(url, BASE, load.instance_id, load)
    e.polled, e.polled_at = True, 0.0  # every send from now on is unseen by that poll
    return e


def tenant(name: str, models=("*",), adapters=()) -> Tenant:
    return Tenant(name, frozenset(), models=tuple(models), adapters=tuple(adapters))


SQL, CHAT = "sql@d1", "chat@d2"


def catalog() -> dict[str, list[Engine]]:
    return {
        BASE: [
            lora_engine("http://a", {"sql": SQL}),
            lora_engine("http://b", {"sql": SQL, "chat": CHAT}),
            lora_engine("http://c"),
        ],
        "other-m": [],
    }


# -- resolving `model` -----------------------------------------------------------------------------


def test_a_granted_adapter_resolves_to_its_base_and_the_engines_that_serve_it():
    engines = catalog()
    acme = tenant("acme", adapters=["sql"])
    assert resolve(BASE, acme, engines) == Resolved(BASE)  # a configured model: as before
    assert resolve("sql", acme, engines) == Resolved(BASE, "sql", SQL)
    assert [e.url for e in adapter_engines(engines[BASE], "sql")] == ["http://a", "http://b"]
    assert [e.url for e in adapter_engines(engines[BASE], "chat")] == ["http://b"]
    assert len(adapter_engines(engines[BASE], None)) == 3  # the base model: every engine
    assert resolve("chat", tenant("star", adapters=["*"]), engines) == Resolved(BASE, "chat", CHAT)


def test_an_ungranted_adapter_is_404_exactly_as_an_unknown_model():
    engines = catalog()
    acme = tenant("acme", adapters=["sql"])

    def refusal(name: str, who: Tenant = acme) -> dict:
        with pytest.raises(APIError) as err:
            resolve(name, who, engines)
        assert err.value.status == 404
        body = err.value.body()["error"]
        body["message"] = body["message"].replace(repr(name), "NAME")
        return body

    unknown = refusal("no-such-model")
    assert unknown == {
        "message": f"model NAME does not exist; models you may use: {BASE}, other-m, sql",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert refusal("chat") == unknown  # it exists, on engine b: the tenant must not learn that
    # Granted every adapter, but not the base model they run on: not found either.
    elsewhere = tenant("elsewhere", models=["other-m"], adapters=["*"])
    assert refusal("sql", elsewhere) == refusal("no-such-model", elsewhere)
    assert "sql" not in refusal("no-such-model", elsewhere)["message"]
    with pytest.raises(APIError) as err:
        resolve(BASE, elsewhere, engines)
    assert err.value.status == 403 and err.value.code == "model_not_allowed"  # a base model: as before


def test_an_adapter_no_routable_engine_reports_is_not_found_and_a_model_name_wins():
    engines = catalog()
    star = tenant("star", adapters=["*"])
    for e in engines[BASE]:
        e.ejected = e.url != "http://c"
    routable = {m: [e for e in es if e.routable] for m, es in engines.items()}
    with pytest.raises(APIError, match="does not exist"):
        resolve("sql", star, routable)
    engines[BASE][2].load = LoadReport(lora_adapters={"other-m": "other-m@x"}, lora_slots=1)
    assert resolve("other-m", star, engines) == Resolved("other-m")  # a configured name is the model


def test_the_identity_is_the_one_most_engines_report():
    es = [lora_engine("http://a", {"sql": "sql@new"}), lora_engine("http://b", {"sql": "sql@old"}),
          lora_engine("http://c", {"sql": "sql@new"}), lora_engine("http://d")]  # fmt: skip
    assert adapter_identity_of(es, "sql") == "sql@new"
    assert adapter_identity_of(es[:2], "sql") == "sql@new"  # a tie: the same answer every time
    assert adapter_identity_of(es, "chat") is None


def test_a_hand_off_comes_only_from_engines_with_the_decode_engines_identity():
    decode = lora_engine("http://d", {"sql": "sql@new"})
    same, old, none = (lora_engine("http://p", {"sql": "sql@new"}), lora_engine("http://q", {"sql": "sql@old"}),
                       lora_engine("http://r"))  # fmt: skip
    assert handoff_peers([same, old, none], decode, "sql") == [same]
    assert handoff_peers([same, old, none], decode, None) == [same, old, none]  # the base model: any
    other_kv = lora_engine("http://s", {"sql": "sql@new"})
    other_kv.load = replace(other_kv.load, kv_format="hm1:L30:H3:D64:B16:int8:w1")  # decode's is ""
    assert handoff_peers([same, other_kv], decode, "sql") == [same]  # its blocks would be refused
    assert handoff_peers([same, other_kv], decode, None) == [same]


def test_models_listing_per_tenant():
    engines = catalog()

    def ids(who: Tenant) -> list[tuple[str, str | None]]:
        return [(m["id"], m["parent"]) for m in listed_models(who, engines)]

    assert ids(tenant("none")) == [(BASE, None), ("other-m", None)]
    assert ids(tenant("acme", adapters=["sql", "not-served"])) == [(BASE, None), ("other-m", None), ("sql", BASE)]
    assert ids(tenant("star", models=[BASE], adapters=["*"])) == [(BASE, None), ("chat", BASE), ("sql", BASE)]
    assert ids(tenant("elsewhere", models=["other-m"], adapters=["*"])) == [("other-m", None)]
    first = listed_models(tenant("acme", adapters=["sql"]), engines)[-1]
    assert first == {"id": "sql", "object": "model", "created": 0, "owned_by": "kvharbor", "parent": BASE}


# -- routing ---------------------------------------------------------------------------------------


class Index:
    """A KV index that answers `held` (instance -> blocks) and records what it was asked."""

    def __init__(self, held: dict[str, int] | None = None) -> None:
        self.held = held or {}
        self.asked: list[tuple[str, list[bytes]]] = []

    async def lookup(self, model, hashes, ids):
        self.asked.append((model, list(hashes)))
        return {i: n for i, n in self.held.items() if i in ids}

    async def close(self) -> None:
        pass


def route(engines, held=None, prompt=512, adapter="x", config=None):
    router = Router(config or RoutingConfig(imbalance_threshold=100), Index(held))
    hashes = [bytes([i]) * 16 for i in range(prompt // 16)]
    return asyncio.run(router.choose(BASE, engines, hashes, prompt, 16, 0.2, adapter))


def three_states() -> tuple[Engine, Engine, Engine]:
    """x is active on A, F has a free slot, S must evict y or z to take it."""
    served = {"x": "x@1", "y": "y@1", "z": "z@1"}
    a = lora_engine("http://a", served, active=("x", "y"))
    f = lora_engine("http://f", served, active=("y",))
    s = lora_engine("http://s", served, active=("y", "z"))
    return a, f, s


def test_adapter_slot_costs_in_seconds():
    a, f, s = three_states()
    assert [adapter_slot(e, "x") for e in (a, f, s)] == [AdapterSlot.ACTIVE, AdapterSlot.FREE_SLOT, AdapterSlot.SWAP]
    assert [adapter_cost_s(e, "x") for e in (a, f, s)] == [0.0, LORA_SWAP_S, 2 * LORA_SWAP_S]
    assert adapter_cost_s(s, None) == 0.0  # the base model never waits for a slot
    # 512 uncached tokens at 1,000 tokens/s, plus the slot cost
    assert predict(s, 512, 0, 16, "x").ttft_s == pytest.approx(0.512 + 2 * LORA_SWAP_S)
    assert predict(s, 512, 0, 16).ttft_s == pytest.approx(0.512)
    assert LoadReport(lora_slots=0).lora_free_slots == 0 and lora_engine("http://o", slots=0).lora_free_slots == 0


def test_routing_prefers_active_then_a_free_slot_then_a_swap():
    a, f, s = three_states()
    # All idle and cold: the score ties, so the first listed (S) is the score's pick; the
    # predictions then move the request by its slot cost alone.
    chosen = route([s, f, a])
    assert chosen.engine is a and chosen.reason == "latency"
    assert route([s, f]).engine is f
    assert route([s]).engine is s
    # Load alone (the index is down): the slot breaks the queue tie.
    router = Router(RoutingConfig())
    picked = asyncio.run(router.choose(BASE, [s, f, a], [b"\0" * 16], 16, 16, 0.2, "x"))
    assert picked.engine is a and picked.reason == "index_unavailable"
    # The base model has no slot to wait for: S stays.
    assert route([s, f, a], adapter=None).engine is s


def test_the_swap_is_traded_against_the_prefix_and_the_queue():
    a, _f, s = three_states()
    # S holds 30 of the 32 blocks: 32 tokens to prefill + 40 ms of swap beat A's 512-token miss.
    held = route([a, s], held={"S": 30})
    assert held.engine is s and held.reason == "prefix"
    # One block held is 16 tokens: not worth the swap (0.496 + 0.040 s against 0.512 s).
    assert route([a, s], held={"S": 1}).engine is a
    # A queue on the active engine: 100 tokens queued there (0.612 s) lose to the swap (0.552 s),
    # 30 tokens (0.542 s) do not.
    busy_a = lora_engine("http://a", {"x": "x@1"}, active=("x",), waiting=1, waiting_tokens=100)
    assert route([busy_a, s]).engine is s
    warm_a = lora_engine("http://a", {"x": "x@1"}, active=("x",), waiting=1, waiting_tokens=30)
    assert route([warm_a, s]).engine is warm_a
    # Admission counts the slot cost too: with 10 tokens queued, S's 0.522 s + 0.040 s of swap
    # misses a 0.55 s TTFT target (an idle engine always fits); for the base model S fits.
    queued_s = lora_engine("http://s", {"x": "x@1"}, active=("y", "z"), waiting=1, waiting_tokens=10)
    first = route([queued_s])
    fitted = fit_route(first, [queued_s, a], 512, 16, 0.55, "x")
    assert fitted.engine is a and fitted.reason == "slo"
    assert fit_route(first, [queued_s, a], 512, 16, 0.55) is first


def test_a_burst_for_one_adapter_follows_its_first_request_instead_of_swapping_everywhere():
    """No poll during the burst: every engine must swap x in. The first request does on A; the
    gateway's own open requests make x active there, so the next ones follow it until A's queue
    costs more than a swap elsewhere."""
    served = {"x": "x@1", "y": "y@1"}
    engines = [lora_engine(f"http://{n}", served, active=("y",), slots=1) for n in "abcd"]
    sent, chosen = [], []
    for _ in range(6):
        r = route(engines, prompt=16)
        chosen.append((r.engine.instance_id, adapter_slot(r.engine, "x").value))
        sent.append(r.engine.send(16, "x"))
    # Request k on A waits behind k prompts of 16 tokens: 16 x (k + 1) ms, against 16 + 40 ms of
    # swap on an idle engine: k = 0..2 stay on A; k = 3 swaps x into B, which then takes the rest
    # (its queue is the shorter) before a third engine is worth a swap.
    assert chosen == [("A", "swap"), ("A", "active"), ("A", "active"), ("B", "swap"), ("B", "active"),
                      ("B", "active")]  # fmt: skip
    assert engines[0].lora_free_slots == 0 and "x" in engines[0].active_adapters
    assert all("x" not in e.active_adapters for e in engines[2:])
    for s in sent:
        s.done()
    assert all(adapter_slot(e, "x") is AdapterSlot.SWAP for e in engines)  # done: the poll's word again


def test_requests_sent_take_free_slots():
    e = lora_engine("http://a", {"x": "x@1", "y": "y@1", "z": "z@1"}, active=("y",), slots=2)
    assert e.lora_free_slots == 1 and adapter_slot(e, "z") is AdapterSlot.FREE_SLOT
    sent = e.send(100, "x")
    assert e.lora_free_slots == 0 and adapter_slot(e, "z") is AdapterSlot.SWAP
    assert adapter_slot(e, "x") is AdapterSlot.ACTIVE
    base = e.send(100)  # the base model takes no slot
    assert e.active_adapters == {"x", "y"}
    sent.done(), base.done()
    assert e.lora_free_slots == 1


# -- the app, in front of fake engines -------------------------------------------------------------

KEYS = {"sk-acme": "acme", "sk-star": "star", "sk-none": "none", "sk-else": "elsewhere"}
TENANTS = {
    "tenants": [
        {"name": "acme", "api_keys": [hash_key("sk-acme")], "adapters": ["sql"]},
        {"name": "star", "api_keys": [hash_key("sk-star")], "adapters": ["*"]},
        {"name": "none", "api_keys": [hash_key("sk-none")]},
        {"name": "elsewhere", "api_keys": [hash_key("sk-else")], "models": ["other-m"], "adapters": ["*"]},
    ]
}
SERVED = {"http://a": {"sql": SQL}, "http://b": {"sql": SQL, "chat": CHAT}, "http://c": {}}
PROMPT = list(range(1, 41))  # 2 full blocks of 16


class FakeEngines:
    """Engines behind httpx.MockTransport: they answer like ours (404 model_not_found for an
    adapter they lack) and record each request's (engine, body), and which adapters the gateway
    counted active on that engine while it ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.active_during: list[frozenset[str]] = []
        self.pool: EnginePool | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        body = json.loads(request.content)
        self.calls.append((url, body))
        self.active_during.append(next(e for e in self.pool.all() if e.url == url).active_adapters)
        if body["model"] != BASE and body["model"] not in SERVED[url]:
            return httpx.Response(404, json={"error": {"message": "no", "type": "not_found_error",
                                                       "param": "model", "code": "model_not_found"}})  # fmt: skip
        usage = {"prompt_tokens": len(body["prompt_token_ids"]), "completion_tokens": 2, "total_tokens": 42}
        if body.get("stream"):
            chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b", "c")]
            chunks.append({"choices": [], "usage": usage})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
        choices = [{"index": 0, "text": "ab", "finish_reason": "length"}]
        return httpx.Response(200, json={"object": "text_completion", "model": body["model"], "usage": usage,
                                         "choices": choices})  # fmt: skip


def gateway(fake: FakeEngines, index: Index):
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    active = {"http://a": ("sql",)}
    pool = fake.pool = polled_pool(
        http, BASE, list(SERVED),
        lambda url: {"lora_adapters": SERVED[url], "lora_active": active.get(url, ()), "lora_slots": 2},
    )  # fmt: skip
    state = gateway_state(http, pool, {BASE: None, "other-m": None}, TENANTS, index)
    return build_app(state), http


def run_app(session):
    """Run `session(client, fake, index)` against the app; returns what it returns."""

    async def main():
        fake, index = FakeEngines(), Index()
        app, http = gateway(fake, index)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            try:
                return await session(client, fake, index)
            finally:
                await http.aclose()

    return asyncio.run(main())


def complete(client, key: str, model: str, **extra):
    return client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "prompt_token_ids": PROMPT, "max_tokens": 2, **extra},
    )


def test_an_adapter_request_runs_on_an_engine_that_serves_it_hashed_under_its_identity():
    async def session(client, fake, index):
        resp = await complete(client, "sk-acme", "sql")
        assert resp.status_code == 200, resp.text
        (engine, body), = fake.calls  # fmt: skip
        assert engine == "http://a"  # sql is active there
        assert body["model"] == "sql" and body["cache_salt"] == "tenant:acme"  # forwarded unchanged
        (model, hashes), = index.asked  # fmt: skip
        assert model == BASE  # the base model's KV index
        assert hashes == block_hashes(PROMPT, 16, BASE, "tenant:acme", adapter=SQL)
        assert hashes != block_hashes(PROMPT, 16, BASE, "tenant:acme")  # never the base's blocks
        assert hashes != block_hashes(PROMPT, 16, BASE, "tenant:acme", adapter="sql")  # the identity, not the name

        fake.calls.clear()
        for _ in range(3):
            assert (await complete(client, "sk-star", "chat")).status_code == 200
        assert {url for url, _ in fake.calls} == {"http://b"}  # the only engine with chat
        # b's poll has no adapter active; while a request runs there, the gateway counts chat active.
        assert fake.active_during[-1] == {"chat"}

        base = await complete(client, "sk-none", BASE)
        assert base.status_code == 200
        assert index.asked[-1][1] == block_hashes(PROMPT, 16, BASE, "tenant:none")

    run_app(session)


def test_ungranted_and_unknown_adapters_get_the_same_404_from_the_app():
    async def session(client, fake, index):
        ungranted = await complete(client, "sk-acme", "chat")
        unknown = await complete(client, "sk-acme", "nope")
        assert ungranted.status_code == unknown.status_code == 404
        assert ungranted.json()["error"]["code"] == "model_not_found"
        assert ungranted.json()["error"]["message"].replace("'chat'", "X") == unknown.json()["error"][
            "message"
        ].replace("'nope'", "X")
        assert (await complete(client, "sk-none", "sql")).status_code == 404  # no grant by default
        assert (await complete(client, "sk-else", "sql")).status_code == 404  # granted, but not the base
        assert fake.calls == [] and index.asked == []

    run_app(session)


def test_models_endpoint_lists_granted_adapters_with_their_parent():
    async def session(client, fake, index):
        async def listing(key):
            resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200
            return [(m["id"], m["parent"]) for m in resp.json()["data"]]

        assert await listing("sk-acme") == [(BASE, None), ("other-m", None), ("sql", BASE)]
        assert await listing("sk-star") == [(BASE, None), ("other-m", None), ("chat", BASE), ("sql", BASE)]
        assert await listing("sk-none") == [(BASE, None), ("other-m", None)]
        assert await listing("sk-else") == [("other-m", None)]

    run_app(session)


def test_metrics_per_adapter():
    async def session(client, fake, index):
        assert (await complete(client, "sk-acme", "sql")).status_code == 200
        streamed = await complete(client, "sk-acme", "sql", stream=True)
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert (await complete(client, "sk-star", "chat")).status_code == 200
        assert (await complete(client, "sk-none", BASE, stream=True)).status_code == 200
        return (await client.get("/metrics")).text

    text = run_app(session)

    def value(series: str) -> float:
        match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        assert match, f"{series} not in /metrics"
        return float(match.group(1))

    assert value(f'kvharbor_gateway_adapter_requests_total{{adapter="sql",model="{BASE}",status="ok"}}') == 2
    assert value(f'kvharbor_gateway_adapter_requests_total{{adapter="chat",model="{BASE}",status="ok"}}') == 1
    assert value(f'kvharbor_gateway_adapter_requests_total{{adapter="",model="{BASE}",status="ok"}}') == 1
    assert value(f'kvharbor_gateway_adapter_tokens_total{{adapter="sql",kind="prompt",model="{BASE}"}}') == 80
    assert value(f'kvharbor_gateway_adapter_tokens_total{{adapter="sql",kind="completion",model="{BASE}"}}') == 4
    sql_ttft = f'kvharbor_gateway_adapter_time_to_first_token_seconds_count{{adapter="sql",model="{BASE}"}}'
    assert value(sql_ttft) == 1  # the streamed one
    assert value(f'kvharbor_gateway_adapter_inter_token_latency_seconds_count{{adapter="sql",model="{BASE}"}}') == 2
    assert value(f'kvharbor_gateway_adapter_time_to_first_token_seconds_count{{adapter="",model="{BASE}"}}') == 1
    assert value(f'kvharbor_gateway_adapter_routes_total{{adapter="sql",model="{BASE}",slot="active"}}') == 2
    assert value(f'kvharbor_gateway_adapter_routes_total{{adapter="chat",model="{BASE}",slot="free_slot"}}') == 1
    # The series that were there before keep their names and labels.
    assert value(f'kvharbor_gateway_requests_total{{model="{BASE}",status="ok",tenant="acme"}}') == 2
    assert value('kvharbor_gateway_time_to_first_token_seconds_count{tenant="acme"}') == 1
