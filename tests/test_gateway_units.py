"""Gateway parts on their own: tenants files, the admission queue's order, routing scores and
discovery files. Rate limits (Redis, Redis Cluster and the local fallback) are in
test_gateway_limits.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import yaml

from kvharbor.common.load_report import LoadReport
from kvharbor.gateway.admission import AdmissionQueue, QueueTimeout, Shed, fit_route
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.discovery import StaticDiscovery
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.predict import Prediction, predict_ttft_s
from kvharbor.gateway.router import Route, Router, block_size_for
from kvharbor.gateway.tenants import Limits, TenantRegistry, TenantsError, hash_key, parse_tenants

# -- tenants ---------------------------------------------------------------------------------------


def tenants_doc(**fields) -> dict:
    return {"tenants": [{"name": "acme", "api_keys": [hash_key("k1")], **fields}]}


def test_tenants_parse_and_authenticate(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(tenants_doc(priority=-2, limits={"rpm": 3}, cache_sharing_group="public")))
    registry = TenantRegistry(path)
    tenant = registry.authenticate("k1")
    assert tenant.name == "acme" and tenant.sheddable and tenant.limits == Limits(rpm=3)
    assert tenant.cache_salt == "group:public" and tenant.may_use("anything")
    assert registry.authenticate("k2") is None
    assert "k1" not in path.read_text()  # only the hash is stored


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tenants": "x"}, "'tenants' list"),
        ({"tenants": [{"name": "a b", "api_keys": []}]}, "name must be"),
        ({"tenants": [{"name": "a", "api_keys": ["plaintext-key"]}]}, "sha256"),
        (tenants_doc(priority="high"), "priority must be an integer"),
        (tenants_doc(limits={"rpm": 0}), "limits.rpm must be a positive integer"),
        (tenants_doc(limits={"rps": 3}), "limits takes"),
        (tenants_doc(models="*"), "models must be a list"),
        (tenants_doc(colour="blue"), "unknown fields"),
        (
            {"tenants": [{"name": "a", "api_keys": [hash_key("k")]}, {"name": "b", "api_keys": [hash_key("k")]}]},
            "also belongs",
        ),
        ({"tenants": [{"name": "a", "api_keys": []}, {"name": "a", "api_keys": []}]}, "appears twice"),
    ],
)
def test_bad_tenants_files_are_refused_with_the_reason(doc, message):
    with pytest.raises(TenantsError, match=message):
        parse_tenants(doc)


def test_a_broken_edit_keeps_the_last_good_tenants(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(tenants_doc()))
    registry = TenantRegistry(path)
    path.write_text("tenants: [ {name: ")  # half-written
    assert registry.refresh() is False and "not valid YAML" in registry.last_error
    assert registry.authenticate("k1").name == "acme"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "beta", "api_keys": [hash_key("k2")]}]}))
    assert registry.refresh() is True
    assert registry.authenticate("k1") is None and registry.authenticate("k2").name == "beta"
    with pytest.raises(TenantsError, match="does not exist"):
        TenantRegistry(tmp_path / "missing.yaml")


# -- admission -------------------------------------------------------------------------------------


def test_prediction():
    assert predict_ttft_s(1000, 500, 1500.0) == 1.0
    assert predict_ttft_s(10**6, 10, 0.0) == 0.0  # no measurement yet: no evidence against admitting


def _prefilling(url: str, instance: str, waiting_tokens: int, rate: float = 1000.0) -> Engine:
    e = Engine(url, "m", instance, LoadReport(waiting_prefill_tokens=waiting_tokens, prefill_tokens_per_s=rate))
    e.polled = True
    return e


def test_fit_route_keeps_a_fitting_choice_moves_to_the_fastest_fit_or_gives_none():
    a, b, c = _prefilling("http://a", "A", 900), _prefilling("http://b", "B", 100), _prefilling("http://c", "C", 300)
    route = Route(a, "prefix", matched_blocks=30, prompt_blocks=32, held={"http://a": 30})
    # On A: 900 queued + 512 - 30 x 16 = 32 uncached -> 0.93 s; B: 100 + 512 -> 0.61 s; C: 0.81 s.
    assert fit_route(route, [a, b, c], 512, 16, slo_ttft_s=1.0) is route
    moved = fit_route(route, [a, b, c], 512, 16, slo_ttft_s=0.85)
    assert moved.engine is b and moved.reason == "slo" and moved.matched_blocks == 0
    assert moved.kv_prefix_source(b) == "shared"  # A still holds the prefix: B pulls it
    assert fit_route(route, [a, b, c], 512, 16, slo_ttft_s=0.5) is None  # queue or shed
    idle = _prefilling("http://d", "D", 0)  # nothing queued: fits whatever the prompt's length
    assert fit_route(route, [a, idle], 10**6, 16, slo_ttft_s=0.1).engine is idle


def _decoding(url: str, running: int, step_ms: float, ms_per_seq: float = 10.0) -> Engine:
    report = LoadReport(running=running, decode_step_ms=step_ms, decode_batch=running, decode_ms_per_seq=ms_per_seq,
                        prefill_tokens_per_s=1000.0)  # fmt: skip
    e = Engine(url, "m", url[-1].upper(), report)
    e.polled = True
    return e


def test_itl_prediction_follows_the_measured_step_and_its_growth_per_sequence():
    flooded = _decoding("http://a", running=16, step_ms=180.0, ms_per_seq=10.0)
    assert flooded.predicted_itl_s() == pytest.approx(0.19)  # one more sequence: +10 ms
    assert _decoding("http://b", running=0, step_ms=0.0).predicted_itl_s() == 0.0  # unmeasured: no evidence


def test_itl_prediction_counts_the_context_the_engine_runs_and_this_prompt_adds():
    """Two engines with the same batch and measured step: the one whose sequences hold long
    contexts is predicted slower, and a long prompt adds its own context to the step it joins."""
    def engine(url: str, context: int, queued: int = 0) -> Engine:
        e = _decoding(url, running=4, step_ms=50.0, ms_per_seq=2.0)
        e.load = replace(e.load, decode_context_tokens=1600.0, decode_us_per_context_token=10.0,
                         context_tokens=context, waiting_prefill_tokens=queued)  # fmt: skip
        return e

    short, long = engine("http://a", 1600), engine("http://b", 8000)
    assert short.predicted_itl_s() == pytest.approx(0.052)
    assert long.predicted_itl_s() == pytest.approx(0.052 + 0.064)
    assert long.predicted_itl_s(prompt_tokens=1000) == pytest.approx(0.052 + 0.074)
    assert engine("http://c", 1600, queued=500).predicted_itl_s() == pytest.approx(0.057)  # queued prompts join
    sent = short.send(100, None, 400)  # unseen by the last poll: its whole prompt counts (300 were cached)
    assert short.predicted_itl_s() == pytest.approx(0.054 + 0.004)
    sent.first_token()
    assert short.predicted_itl_s() == pytest.approx(0.054 + 0.004)  # still its context after the first token
    sent.done()
    assert fit_route(Route(long, "score"), [long, short], 1000, 16, slo_ttft_s=10, slo_itl_s=0.1).engine is short


def test_fit_route_admits_against_the_itl_slo_too():
    """A decode-heavy engine has nothing waiting to prefill: the TTFT rule alone admits there.
    With the ITL rule it does not fit; a calmer engine does, or the request waits."""
    flooded = _decoding("http://a", running=16, step_ms=180.0)  # 190 ms with one more
    calm = _decoding("http://b", running=2, step_ms=60.0)  # 70 ms
    route = Route(flooded, "prefix", matched_blocks=8, prompt_blocks=8, held={"http://a": 8})
    assert fit_route(route, [flooded, calm], 128, 16, slo_ttft_s=2.0) is route  # TTFT only: no objection
    moved = fit_route(route, [flooded, calm], 128, 16, slo_ttft_s=2.0, slo_itl_s=0.1)
    assert moved.engine is calm and moved.reason == "slo"
    assert fit_route(route, [flooded], 128, 16, slo_ttft_s=2.0, slo_itl_s=0.1) is None  # queue, or shed
    assert fit_route(route, [flooded], 128, 16, slo_ttft_s=2.0, slo_itl_s=0.2) is route
    # An engine that runs nothing fits even if its measured step is over the SLO: waiting cannot
    # make that step faster, and refusing would starve every request.
    slow_machine = _decoding("http://c", running=0, step_ms=300.0)
    assert fit_route(route.to(slow_machine, "prefix"), [slow_machine], 128, 16, 2.0, slo_itl_s=0.1) is not None


def test_queue_serves_priority_first_and_tenants_in_turn():
    async def main():
        queue = AdmissionQueue(max_queue=10, timeout=5)
        capacity = {"free": 0}
        order: list[str] = []

        def gate(label):
            async def try_now():
                if capacity["free"] > 0:
                    capacity["free"] -= 1
                    order.append(label)
                    return label
                return None

            return try_now

        arrivals = [("a", 0, "a1"), ("a", 0, "a2"), ("a", 0, "a3"), ("b", 0, "b1"), ("vip", 5, "v1")]
        tasks = []
        for tenant_name, prio, label in arrivals:
            tasks.append(asyncio.create_task(queue.admit(tenant_name, prio, False, gate(label))))
            await asyncio.sleep(0.01)
        assert queue.size == 5
        with pytest.raises(Shed, match="slo"):
            await queue.admit("low", -1, True, gate("low"))  # sheddable: refused at once while others wait
        capacity["free"] = 5
        queue.wake()
        await asyncio.gather(*tasks)
        assert order == ["v1", "a1", "b1", "a2", "a3"]  # priority, then tenants take turns

    asyncio.run(main())


def test_queue_deadline_and_bound():
    async def main():
        queue = AdmissionQueue(max_queue=1, timeout=0.3)

        async def never():
            return None

        waiter = asyncio.create_task(queue.admit("a", 0, False, never))
        await asyncio.sleep(0.05)
        with pytest.raises(Shed, match="queue_full"):
            await queue.admit("b", 0, False, never)
        with pytest.raises(QueueTimeout):
            await waiter
        assert queue.size == 0

    asyncio.run(main())


# -- routing ---------------------------------------------------------------------------------------


def engine(url, instance, running=0, waiting=0, free=100, total=100) -> Engine:
    e = Engine(
        url, "m", instance, LoadReport(running=running, waiting=waiting, kv_blocks_free=free, kv_blocks_total=total)
    )
    e.polled = True
    return e


def test_prefix_score_load_imbalance_and_shared_source():
    router = Router(RoutingConfig(imbalance_threshold=4))
    a, b = engine("http://a", "A"), engine("http://b", "B", running=2)
    hashes = [bytes([i]) * 16 for i in range(10)]
    route = router.by_prefix([a, b], hashes, {"A": 0, "B": 10})
    assert route.engine is b and route.reason == "prefix"
    assert route.kv_prefix_source(b) is None and route.kv_prefix_source(a) == "shared"  # a retry on A pulls
    busy_b = engine("http://b", "B", running=9)
    route = router.by_prefix([a, busy_b], hashes, {"A": 0, "B": 10})
    assert route.engine is a and route.reason == "imbalance"
    assert route.kv_prefix_source(a) == "shared" and route.kv_prefix_source(busy_b) is None
    route = router.by_prefix([a, b], hashes, None)
    assert route.engine is a and route.reason == "index_unavailable"
    full = engine("http://c", "C", free=0)
    route = router.by_prefix([full, engine("http://d", "D")], hashes, {"C": 2, "D": 0})
    assert route.engine.instance_id == "D"  # 2 x 0.2 prefix < 1 x free KV


def test_the_block_size_is_the_engines_and_a_disagreement_is_reported():
    def sized(url, size, polled=True):
        e = Engine(url, "m", url[-1], LoadReport(block_size=size))
        e.polled = polled
        return e

    assert block_size_for(None, []) == (16, None)  # nothing reported yet: the default
    assert block_size_for(64, [sized("http://a", 0)]) == (64, None)  # an engine too old to say: the pin
    assert block_size_for(None, [sized("http://a", 32), sized("http://b", 32)]) == (32, None)
    assert block_size_for(None, [sized("http://a", 32), sized("http://b", 8, polled=False)]) == (32, None)
    size, problem = block_size_for(16, [sized("http://a", 32)])
    assert size == 32 and "pins block_size 16 but the engines use 32" in problem
    size, problem = block_size_for(None, [sized("http://a", 32), sized("http://b", 32), sized("http://c", 16)])
    assert size == 32 and "[16, 32]" in problem


def _idle(url: str, instance: str) -> Engine:
    """An idle engine that has measured 1,000 prefill tokens/s and a 20 ms decode step at one
    sequence, growing 2 ms per sequence."""
    load = LoadReport(prefill_tokens_per_s=1000.0, decode_step_ms=20.0, decode_batch=1.0, decode_ms_per_seq=2.0)
    e = Engine(url, "m", instance, load)
    e.polled, e.polled_at = True, 0.0
    return e


def test_predictions_count_what_this_gateway_sent_since_the_last_poll():
    e = _idle("http://a", "A")
    assert (e.queue, e.waiting_prefill_tokens, e.predicted_itl_s()) == (0, 0, 0.020)
    first, second = e.send(300), e.send(200)
    assert (e.queue, e.waiting_prefill_tokens) == (2, 500)
    assert e.predicted_itl_s() == pytest.approx(0.024)  # a step of 3 sequences: 20 + 2 x 2 ms
    first.first_token()
    assert (e.queue, e.waiting_prefill_tokens) == (2, 200)
    e.polled_at = second.at + 1.0  # a poll answered after both were sent: its report holds them
    assert (e.queue, e.waiting_prefill_tokens) == (0, 0)
    first.done(), second.done()
    assert not e.sent
    mine = Prediction(0.2, 0.02)
    assert Prediction(0.1, 0.02).better_than(mine, slo_itl_s=0.0)
    assert not Prediction(0.1, 0.03).better_than(mine, slo_itl_s=0.0)  # a worse ITL, no SLO room
    assert Prediction(0.1, 0.03).better_than(mine, slo_itl_s=0.05)  # a worse ITL within the SLO
    assert Prediction(0.2, 0.01).better_than(mine, slo_itl_s=0.0)  # the same TTFT, a better ITL
    assert not Prediction(0.3, 0.001).better_than(mine, slo_itl_s=1.0)  # a hit is not traded for ITL


def test_a_burst_of_one_prefix_spreads_once_the_holder_is_predicted_slower():
    """Issue 17's burst: same-prefix requests to two idle engines, no poll in between. The holder
    takes them while its prediction (its queue, which grows with each send) is not worse than the
    other's with that engine's cache miss; then the other takes the next."""

    async def main():
        router = Router(RoutingConfig(imbalance_threshold=100))  # the guard, not the imbalance rule
        a, b = _idle("http://a", "A"), _idle("http://b", "B")

        class Index:  # A holds 30 of the prompt's 32 blocks; B nothing (the burst is not indexed yet)
            async def lookup(self, model, hashes, ids):
                return {"A": 30}

        router.index = Index()
        hashes = [bytes([i]) * 16 for i in range(32)]
        chosen = []
        for _ in range(20):
            route = await router.choose("m", [a, b], hashes, prompt_tokens=512, block_size=16, slo_itl_s=0.2)
            route.engine.send(512 - route.held.get(route.engine.url, 0) * 16)
            chosen.append((route.engine.instance_id, route.reason))
        return chosen

    chosen = asyncio.run(main())
    # On A, request k (from 0) waits behind k tails of 32 tokens and its own: 32 x (k + 1) ms
    # against B's 512-token miss (512 ms). A's ITL is worse from the 2nd on, its TTFT better up to
    # k = 14 (a hit is not traded for ITL); at k = 15 the TTFTs tie and B's ITL is better.
    first_b = [who for who, _ in chosen].index("B")
    assert chosen[:first_b] == [("A", "prefix")] * first_b and chosen[first_b] == ("B", "latency")
    assert first_b == 15
    assert {who for who, _ in chosen[first_b:]} == {"A", "B"}  # from then on both take the burst


def test_a_pull_is_asked_for_only_from_holders_whose_blocks_the_engine_can_read():
    """Engines of another kv_format (an int8 KV cache, other weights) write blocks this one would
    refuse: their holding the prefix is no reason to pull it from the shared store."""
    router = Router(RoutingConfig(imbalance_threshold=100))
    hashes = [bytes([i]) * 16 for i in range(10)]
    a, b, c = engine("http://a", "A"), engine("http://b", "B"), engine("http://c", "C")
    a.load = replace(a.load, kv_format="hm1:L30:H3:D64:B16:float32:w1")
    b.load = replace(b.load, kv_format="hm1:L30:H3:D64:B16:int8:w1")  # the only holder, of another format
    c.load = replace(c.load, kv_format="hm1:L30:H3:D64:B16:float32:w1")
    route = router.by_prefix([a, b, c], hashes, {"B": 10})
    assert route.kv_prefix_source(a) is None and route.kv_prefix_source(c) is None
    route = router.by_prefix([a, b, c], hashes, {"B": 10, "C": 4})
    assert route.kv_prefix_source(a) == "shared"  # C, of A's format, holds 4 blocks
    assert route.kv_prefix_source(c) is None  # nobody of C's format holds more


def test_round_robin_and_least_loaded():
    async def main():
        es = [engine("http://a", "A", running=3), engine("http://b", "B")]
        rr = Router(RoutingConfig(routing="round_robin"))
        assert [(await rr.choose("m", es, [])).engine.url for _ in range(3)] == ["http://a", "http://b", "http://a"]
        ll = Router(RoutingConfig(routing="least_loaded"))
        assert (await ll.choose("m", es, [])).engine.url == "http://b"

    asyncio.run(main())


def test_discovery_files(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        yaml.safe_dump({"models": [{"name": "m", "engines": ["http://127.0.0.1:1/"], "slo": {"ttft_p95_ms": 500}}]})
    )
    (spec,) = StaticDiscovery.from_file(path, 2000, 200).models()
    assert spec.engines == ("http://127.0.0.1:1",) and spec.slo_ttft_ms == 500 and spec.slo_itl_ms == 200
    assert spec.block_size is None  # not pinned: the engines' /load says
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "engines": ["http://127.0.0.1:1"], "block_size": 32}]}))
    assert StaticDiscovery.from_file(path, 1, 1).models()[0].block_size == 32
    for bad in (0, "16", True, 1.5):
        path.write_text(yaml.safe_dump({"models": [{"name": "m", "engines": [], "block_size": bad}]}))
        with pytest.raises(ValueError, match=r"block_size .* must be a positive integer"):
            StaticDiscovery.from_file(path, 1, 1)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        StaticDiscovery.from_flags("127.0.0.1:8000", None, None, 1, 1)
    with pytest.raises(ValueError, match="--engines"):
        StaticDiscovery.from_flags("", None, None, 1, 1)
    path.write_text("models: nope")
    with pytest.raises(ValueError, match="'models' list"):
        StaticDiscovery.from_file(path, 1, 1)


# -- engine calls ----------------------------------------------------------------------------------


def _caller(handler):
    import httpx

    from kvharbor.gateway.engines import EnginePool
    from kvharbor.gateway.proxy import EngineCaller

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = EnginePool(http)
    return EngineCaller(http, pool, 1.0, 5.0, 10.0), pool


def _sse(*chunks: str) -> bytes:
    return "".join(f"data: {c}\n\n" for c in chunks).encode()


def test_an_error_before_the_first_token_moves_the_request():
    import httpx

    from kvharbor.common.openai_api import APIError
    from kvharbor.gateway.proxy import EngineFailed, with_retries

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "bad":
            return httpx.Response(
                200,
                content=_sse(
                    '{"choices":[{"delta":{"role":"assistant"}}]}', '{"error":{"message":"engine died"}}', "[DONE]"
                ),
            )
        if request.url.host == "busy":
            return httpx.Response(503, json={"error": {"message": "draining"}})
        if request.url.host == "picky":
            return httpx.Response(
                400,
                json={
                    "error": {"message": "max_tokens too large", "type": "invalid_request_error", "param": "max_tokens"}
                },
            )
        return httpx.Response(200, content=_sse('{"choices":[{"delta":{"content":"Hi"}}]}', "[DONE]"))

    async def main():
        caller, _pool = _caller(handler)
        bad, good, busy, picky = (Engine(f"http://{h}", "m") for h in ("bad", "good", "busy", "picky"))
        with pytest.raises(EngineFailed, match="before the first token: engine died") as failed:
            await caller.open_stream(bad, "/v1/chat/completions", {}, {})
        assert bad.failures == 0 and failed.value.blame is not None  # counted once another engine serves it
        with pytest.raises(EngineFailed):
            await caller.open_stream(busy, "/v1/chat/completions", {}, {})
        assert busy.draining and busy.failures == 0  # draining is not a failure
        with pytest.raises(APIError) as err:
            await caller.open_stream(picky, "/v1/chat/completions", {}, {})
        assert err.value.status == 400 and err.value.param == "max_tokens"  # the client's fault: no retry

        picked: list[str] = []

        async def pick_next(tried):
            picked.append(",".join(sorted(tried)))
            return good

        async def run(engine):
            stream = await caller.open_stream(engine, "/v1/chat/completions", {}, {})
            return [event.line async for event in stream.events()]

        out = await with_retries(3, bad, pick_next, run)
        assert any('"Hi"' in line for line in out) and picked == ["http://bad"]
        assert bad.failures == 1 and good.failures == 0  # another engine served it: bad is to blame

        async def nowhere(tried):
            picked.append("again")
            return bad

        picked.clear()
        with pytest.raises(APIError) as err:
            await with_retries(2, bad, nowhere, run)
        assert err.value.status == 503 and picked == ["again"]  # no pick after the last attempt
        await caller.http.aclose()

    asyncio.run(main())


def test_a_request_an_engine_refuses_as_its_own_fault_is_not_retried_nor_blamed():
    """Issue 47: an engine's error event of type invalid_request_error before the first token (a
    request its own options failed in the step) is the client's 400, as the engine's 4xx is: no
    other engine is tried, none is blamed, and the refusal is counted by reason."""
    import httpx

    from kvharbor.gateway.proxy import EngineRefused, with_retries

    sent: list[str] = []
    failure = '{"error":{"message":"failed on its own","type":"invalid_request_error","code":"request_failed"}}'

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.host)
        if request.url.host == "stream":
            return httpx.Response(200, content=_sse('{"choices":[{"delta":{"role":"assistant"}}]}', failure))
        return httpx.Response(400, content=failure)

    async def main():
        caller, _pool = _caller(handler)
        for host in ("stream", "unary"):
            engine = Engine(f"http://{host}", "m")

            async def run(e, host=host):
                if host == "stream":
                    return await caller.open_stream(e, "/v1/chat/completions", {}, {})
                return await caller.call(e, "/v1/chat/completions", {}, {})

            async def pick_next(tried):
                raise AssertionError("a refused request was retried")

            with pytest.raises(EngineRefused) as err:
                await with_retries(3, engine, pick_next, run)
            assert err.value.status == 400 and err.value.reason == "request_failed"
            assert engine.failures == 0 and not engine.ejected
        assert sent == ["stream", "unary"]
        await caller.http.aclose()

    asyncio.run(main())


def test_an_engine_with_a_full_queue_is_passed_over_and_every_one_full_is_a_429():
    """Issue 47: an engine's 429 (its max_waiting_requests) is no one's fault: another engine is
    tried, none is blamed; when every engine tried is full the client gets the 429."""
    import httpx

    from kvharbor.common.openai_api import APIError
    from kvharbor.gateway.proxy import with_retries

    full = '{"error":{"message":"queue full","type":"rate_limit_error","code":"engine_queue_full"}}'

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("full"):
            return httpx.Response(429, content=full, headers={"Retry-After": "1"})
        return httpx.Response(200, json={"choices": [], "usage": {}})

    async def main():
        caller, _pool = _caller(handler)
        full1, full2, roomy = (Engine(f"http://{h}", "m") for h in ("full1", "full2", "roomy"))

        async def run(e):
            return await caller.call(e, "/v1/completions", {}, {})

        async def then(engine):
            async def pick_next(tried):
                return engine

            return pick_next

        await with_retries(3, full1, await then(roomy), run)
        with pytest.raises(APIError) as err:
            await with_retries(2, full1, await then(full2), run)
        assert err.value.status == 429 and err.value.code == "engine_queue_full"
        assert full1.failures == full2.failures == roomy.failures == 0
        await caller.http.aclose()

    asyncio.run(main())


def test_a_request_that_fails_on_every_engine_is_blamed_not_the_engines():
    """A poison request (500, or an error event before the first token, from each engine tried)
    ends in a 500 for the client and counts against no engine: sent a few times, it would
    otherwise eject every engine. An engine that says it is unavailable is blamed at once."""
    import httpx

    from kvharbor.common.openai_api import APIError
    from kvharbor.gateway.proxy import with_retries

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "raises":
            return httpx.Response(500, json={"error": {"message": "boom", "type": "internal_error"}})
        if request.url.host == "down":
            return httpx.Response(200, content=_sse('{"error":{"message":"core died","type":"service_unavailable"}}'))
        return httpx.Response(200, content=_sse('{"error":{"message":"sampling failed","type":"internal_error"}}'))

    async def main():
        caller, _pool = _caller(handler)
        raises, errs, down = (Engine(f"http://{h}", "m") for h in ("raises", "errs", "down"))
        order = iter([errs, raises, errs])

        async def pick_next(tried):
            return next(order)

        async def run(engine):
            return await caller.open_stream(engine, "/v1/chat/completions", {}, {})

        for _ in range(4):  # the same poison request again and again
            order = iter([errs])
            with pytest.raises(APIError) as err:
                await with_retries(2, raises, pick_next, run)
            assert err.value.status == 500 and err.value.code == "request_failed_on_every_engine"
        assert raises.failures == errs.failures == 0 and not raises.ejected and not errs.ejected

        order = iter([down])
        with pytest.raises(APIError) as err:
            await with_retries(2, raises, pick_next, run)
        assert err.value.status == 503 and down.failures == 1 and raises.failures == 0

        with pytest.raises(APIError) as err:  # one engine to try: nothing tells the request's fault apart
            await with_retries(1, raises, pick_next, run)
        assert err.value.status == 503 and raises.failures == 1
        await caller.http.aclose()

    asyncio.run(main())


def test_an_unstreamed_call_that_times_out_is_not_run_again():
    import httpx

    from kvharbor.common.openai_api import APIError

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async def main():
        caller, _pool = _caller(handler)
        engine = Engine("http://slow", "m")
        with pytest.raises(APIError) as err:
            await caller.call(engine, "/v1/completions", {}, {})
        assert err.value.status == 504 and engine.failures == 0
        await caller.http.aclose()

    asyncio.run(main())


def test_a_good_poll_does_not_undo_a_passive_ejection_at_once():
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"running": 0, "waiting": 0, "instance_id": "A"})

    async def main():
        caller, pool = _caller(handler)
        engine = Engine("http://a", "m")
        pool.set_engines("m", [])
        pool._engines[engine.url] = engine
        pool.failed(engine, "connect", hard=True)
        await pool.poll_once(engine)
        assert engine.ejected  # still in its cool-down
        engine.cooldown_until = 0
        await pool.poll_once(engine)
        assert not engine.ejected and engine.routable
        await caller.http.aclose()

    asyncio.run(main())


def test_kubernetes_discovery_from_services_and_endpointslices():
    from kvharbor.gateway.discovery import KubernetesDiscovery, ModelSpec, engines_from_slices

    services = [
        {
            "metadata": {
                "name": "llama",
                "namespace": "inf",
                "labels": {"kvharbor.io/discovery": "engine", "kvharbor.io/model": "llama-8b"},
            }
        },
        {"metadata": {"name": "other", "namespace": "inf", "labels": {}}},
    ]
    slices = [
        {
            "metadata": {"namespace": "inf", "labels": {"kubernetes.io/service-name": "llama"}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.6"], "conditions": {"ready": False}},  # draining or starting: not routed
                {"addresses": ["fd00::7"]},
            ],
        },
        {
            "metadata": {"namespace": "inf", "labels": {"kubernetes.io/service-name": "other"}},
            "ports": [{"name": "http", "port": 1}],
            "endpoints": [{"addresses": ["10.9.9.9"]}],
        },
    ]
    assert engines_from_slices(services, slices) == {"llama-8b": ["http://10.0.0.5:8000", "http://[fd00::7]:8000"]}

    async def api_get(path: str) -> dict:
        return {"items": services if "/services" in path else slices}

    discovery = KubernetesDiscovery(api_get, "inf", {"llama-8b": ModelSpec("llama-8b", None, (), 1500, 100)})
    (spec,) = asyncio.run(discovery.refresh())
    assert spec.engines == ("http://10.0.0.5:8000", "http://[fd00::7]:8000") and spec.slo_ttft_ms == 1500
    assert discovery.models() == [spec]


def test_the_operators_engine_service_is_discovered_under_its_exact_model_name():
    """A model name a label cannot hold ("org/model") travels in the Service's annotation."""
    from kvharbor.gateway.discovery import engines_from_slices
    from kvharbor.operator.objects import desired_objects
    from kvharbor.operator.placement import PlacementPlan

    spec = {"model": {"source": "/m", "name": "acme/Llama-3.1-8B-Instruct"}}
    plan = PlacementPlan("l4", 1, 1000, 131072, 1, "NVIDIA-L4")
    service = next(o for o in desired_objects("llama", "inf", "u", spec, plan, 1, "img") if o["kind"] == "Service")
    assert service["metadata"]["labels"]["kvharbor.io/model"] == "acme-Llama-3.1-8B-Instruct"  # a valid label
    endpoint_slice = {
        "metadata": {"namespace": "inf", "labels": {"kubernetes.io/service-name": "llama"}},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": ["10.0.0.5"]}],
    }
    assert engines_from_slices([service], [endpoint_slice]) == {"acme/Llama-3.1-8B-Instruct": ["http://10.0.0.5:8000"]}


def test_a_dual_stack_service_counts_each_engine_once():
    from kvharbor.common.endpoint_slices import service_urls

    labels = {"kubernetes.io/service-name": "llama"}
    v4 = {"metadata": {"labels": labels}, "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
          "endpoints": [{"addresses": ["10.0.0.5"]}]}  # fmt: skip
    v6 = {"metadata": {"labels": labels}, "addressType": "IPv6", "ports": [{"name": "http", "port": 8000}],
          "endpoints": [{"addresses": ["fd00::5"]}]}  # fmt: skip
    assert service_urls([v4, v6]) == ["http://10.0.0.5:8000"]
    assert service_urls([v6]) == ["http://[fd00::5]:8000"]  # an IPv6-only cluster


# -- busy is not dead (issue 47, items 9 and 10) -----------------------------------------------------


def _polled_pool(handler, stall: float):
    import httpx

    from kvharbor.gateway.engines import EnginePool

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = EnginePool(http, eject_after=3, interval=0.05, stall_timeout=stall)
    pool.set_engines("m", ["http://e"])
    return pool, pool.all("m")[0]


def test_late_load_answers_are_busy_until_the_stall_window_passes():
    """Item 10: a prefilling engine's /load timed out three times and it was ejected. Timeouts
    count as nothing until the engine has gone stall_timeout without an answer."""
    import httpx

    answer = {"late": False}

    def handler(request):
        if answer["late"]:
            raise httpx.ReadTimeout("busy", request=request)
        return httpx.Response(200, json={"model": "m", "steps": 5})

    async def main():
        pool, engine = _polled_pool(handler, stall=0.4)
        await pool.poll_once(engine)
        answer["late"] = True
        for _ in range(5):  # five timeouts in 0.25 s: more than eject_after, within the window
            await pool.poll_once(engine)
            await asyncio.sleep(0.05)
        assert engine.routable and engine.failures == 0
        await asyncio.sleep(0.3)
        await pool.poll_once(engine)
        assert engine.ejected  # silent past the window: stalled
        answer["late"] = False
        await pool.poll_once(engine)
        assert engine.routable
        await pool.client.aclose()

    asyncio.run(main())


def test_an_engine_whose_core_stalls_is_ejected_though_it_answers():
    """A core that runs no step while it has requests, or that its API server no longer hears."""
    import httpx

    load = {"model": "m", "steps": 7, "running": 1, "core_silent_s": 0.0}

    def handler(request):
        return httpx.Response(200, json=load)

    async def main():
        pool, engine = _polled_pool(handler, stall=0.3)
        await pool.poll_once(engine)
        await asyncio.sleep(0.2)
        await pool.poll_once(engine)
        assert engine.routable  # still within the window
        load["steps"] = 9  # it stepped: the window starts again
        await pool.poll_once(engine)
        await asyncio.sleep(0.2)
        await pool.poll_once(engine)
        assert engine.routable
        await asyncio.sleep(0.15)
        await pool.poll_once(engine)
        assert engine.ejected  # no step in 0.35 s with a request running
        load.update(steps=10, core_silent_s=0.0)
        await pool.poll_once(engine)
        assert engine.routable
        load["core_silent_s"] = 0.5
        await pool.poll_once(engine)
        assert engine.ejected
        idle = {"model": "m", "steps": 3, "running": 0}
        load.clear()
        load.update(idle)
        for _ in range(3):  # an idle engine's steps stand still: that is no stall
            await pool.poll_once(engine)
            await asyncio.sleep(0.15)
        assert engine.routable
        await pool.client.aclose()

    asyncio.run(main())


def test_an_ejection_moves_the_requests_waiting_on_the_engine_at_once():
    """Item 9: a request kept on a stalled engine got no answer in 100 s. When the engine is
    ejected, the call waiting for its first token there moves to another engine."""
    import httpx

    from kvharbor.gateway.proxy import with_retries

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "stalled":
            await asyncio.sleep(30)
        return httpx.Response(200, content=_sse('{"choices":[{"delta":{"content":"Hi"}}]}', "[DONE]"))

    async def main():
        caller, pool = _caller(handler)
        stalled, good = Engine("http://stalled", "m"), Engine("http://good", "m")

        async def pick_next(tried):
            return good

        async def run(engine):
            stream = await caller.open_stream(engine, "/v1/chat/completions", {}, {})
            return engine.url, [event.line async for event in stream.events()]

        task = asyncio.create_task(with_retries(3, stalled, pick_next, run))
        await asyncio.sleep(0.2)
        assert not task.done()
        started = asyncio.get_running_loop().time()
        pool.failed(stalled, "stalled: test", hard=True)
        url, lines = await asyncio.wait_for(task, 5)
        assert url == "http://good" and any('"Hi"' in line for line in lines)
        assert asyncio.get_running_loop().time() - started < 2
        assert good.failures == 0
        await caller.http.aclose()

    asyncio.run(main())
