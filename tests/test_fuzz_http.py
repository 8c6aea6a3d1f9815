"""Issue 20: fuzzing every HTTP surface. No request may get a 5xx (save 503 with Retry-After), and
none may go unanswered past a bound (fuzz_http.REQUEST_TIMEOUT_S).

Surfaces:
- gateway: the real app in-process (ASGI, and the same app on uvicorn for the header and socket
  cases), a real tokenizer (SmolLM2's), fake engines behind httpx.MockTransport; fast tier;
- engine: a real `kvharbor serve` of a random-weight tiny model (as tests/test_server_errors.py);
  slow tier, one process for the module;
- kvcache: the real app in-process over a real redis-server (conftest's `redis_server`); slow tier.

Classes: the OpenAPI schema of each surface (Schemathesis' strategies under plain Hypothesis,
positive and negative), and hand-made ones: invalid Unicode, huge and odd numbers, deep nesting,
huge and many headers, wrong content types and non-JSON bodies, slow bodies. The slow-body cases
run on each surface's own middleware stack in-process (the engine's over a stub core: the body is
never read to its end, so no route runs).

At the end the module prints how many cases each surface ran, per class.
"""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import httpx
import pytest
import session_report
from fuzz_http import (
    NUMBER_TOKENS,
    TALLY,
    BadAnswer,
    LoopThread,
    Surface,
    UvicornInLoop,
    check_all,
    content_type_cases,
    deep_cases,
    header_cases,
    invalid_unicode_cases,
    slow_body,
    with_token,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

pytestmark = pytest.mark.timeout(300)

GATEWAY_KEY = "sk-fuzz-key"
CAPPED_KEY = "sk-fuzz-capped"
ENGINE_MODEL = "tiny-chat"
KV_MODEL = "fuzz-model"
SLOW_BODY_TIMEOUT_S = 1.0  # the body-read timeout the slow-body cases set (see test_slow_body)
SLOW_BODY_BOUND_S = 4.0  # ... and how long they wait for an answer


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module", autouse=True)
def case_table():
    """Leave the cases each surface ran (per class) for the end of the session."""
    yield
    if TALLY.cases:
        spent = ", ".join(f"{s} {t:.1f}s" for s, t in sorted(TALLY.seconds.items()))
        session_report.add("fuzzing: cases per surface and class", TALLY.table() + f"\ntime in requests: {spent}")


# -- the gateway: in-process, fake engines -------------------------------------------------------------


def _fake_engine(request: httpx.Request) -> httpx.Response:
    """An engine that answers every well-formed request like ours, streamed or not."""
    if request.url.path == "/load":
        return httpx.Response(200, json={"instance_id": request.url.host})
    body = json.loads(request.content)  # the gateway must forward JSON
    prompt = body.get("prompt_token_ids") or [0]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": len(prompt) + 2}
    chat = request.url.path == "/v1/chat/completions"
    if body.get("stream"):
        if chat:
            chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("a", "b")]
        else:
            chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b")]
        chunks.append({"choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": "ab", "finish_reason": "length"}
    return httpx.Response(200, json={"object": "x", "model": body["model"], "usage": usage, "choices": [choice]})


def build_gateway(max_body_bytes: int = 1 << 20, engine_urls: list[str] | None = None, model: str | None = None):
    """The gateway's app over fake engines (httpx.MockTransport), or over the real `engine_urls`."""
    from gateway_state import gateway_state, polled_pool

    from kvharbor.common.model_files import load_tokenizer
    from kvharbor.gateway.app import build_app
    from kvharbor.gateway.tenants import hash_key

    name, tokenizer = _gateway_tokenizer(load_tokenizer)
    name = model or name
    tenants = {"tenants": [
        {"name": "fuzz", "api_keys": [hash_key(GATEWAY_KEY)]},
        {"name": "capped", "api_keys": [hash_key(CAPPED_KEY)], "priority": -1,
         "caps": {"max_tokens": 64, "n": 2, "prompt_tokens": 500, "body_bytes": 200_000}},
    ]}  # fmt: skip
    if engine_urls:
        http = httpx.AsyncClient()
    else:
        http = httpx.AsyncClient(transport=httpx.MockTransport(_fake_engine))
        engine_urls = ["http://engine-a", "http://engine-b"]
    pool = polled_pool(http, name, engine_urls, lambda url: {"kv_blocks_total": 100, "kv_blocks_free": 100})
    state = gateway_state(http, pool, {name: tokenizer}, tenants, max_body_bytes=max_body_bytes)
    app = build_app(state)
    app.state.fuzz_pool, app.state.fuzz_http = pool, http
    return app, name


_TOKENIZER: list = []


def _gateway_tokenizer(load_tokenizer):
    if not _TOKENIZER:
        _TOKENIZER.append(load_tokenizer(None))  # the bundled SmolLM2's, from the GGUF header only
    return _TOKENIZER[0]


def chat_template(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u"}


def completion_template(model: str) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 2, "stop": ["x"]}


@pytest.fixture(scope="module")
def gateway(loop):
    app, model = build_gateway()
    server = UvicornInLoop(loop, app)
    surface = Surface(
        "gateway",
        loop,
        server.url,
        asgi=app,
        headers={"authorization": f"Bearer {GATEWAY_KEY}"},
        body_paths=("/v1/chat/completions", "/v1/completions"),
        templates={"/v1/chat/completions": chat_template(model), "/v1/completions": completion_template(model)},
    )
    yield surface
    surface.close()
    server.close()


# -- the engine: a real `kvharbor serve` ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(loop, tmp_path_factory, tiny_chat_model):
    from servers import EngineServerProcess

    args = ("--model", str(tiny_chat_model), "--dtype", "float32", "--max-model-len", "128",
            "--num-kv-blocks", "64", "--max-n", "4", "--log-level", "warning")  # fmt: skip
    with EngineServerProcess(tmp_path_factory.mktemp("fuzz-serve"), *args) as proc:
        surface = Surface(
            "engine",
            loop,
            proc.url,
            body_paths=("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"),
            templates={
                "/v1/chat/completions": chat_template(ENGINE_MODEL),
                "/v1/completions": completion_template(ENGINE_MODEL),
                "/tokenize": {"model": ENGINE_MODEL, "prompt": "hi"},
                "/detokenize": {"model": ENGINE_MODEL, "tokens": [1, 2]},
            },
        )
        yield surface
        surface.close()
        assert proc.proc.poll() is None, proc.log()[-3000:]


# -- the KV cache service: in-process over a real redis-server -----------------------------------------


def build_kvcache(redis_url: str):
    from kvharbor.kvcache_service.app import build_app
    from kvharbor.kvcache_service.config import IntakeConfig, KVCacheServiceConfig
    from kvharbor.kvcache_service.service import build_state

    config = KVCacheServiceConfig(intake=IntakeConfig(redis_url=redis_url, redis_timeout=2.0))
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, max_lookup_blocks=4096))
    return build_app(build_state(config))  # no lifespan: lookups only, no intake taking streams over


def lookup_template() -> dict:
    return {"model": KV_MODEL, "token_ids": list(range(40)), "cache_salt": "s", "adapter": "a@1", "block_size": 16}


@pytest.fixture(scope="module")
def kvcache(loop, redis_server):
    app = build_kvcache(redis_server.url)
    server = UvicornInLoop(loop, app)
    surface = Surface(
        "kvcache", loop, server.url, asgi=app, body_paths=("/lookup",), templates={"/lookup": lookup_template()}
    )
    yield surface
    surface.close()
    server.close()


@pytest.fixture(params=["gateway", pytest.param("engine", marks=pytest.mark.slow),
                        pytest.param("kvcache", marks=pytest.mark.slow)])  # fmt: skip
def surface(request) -> Surface:
    return request.getfixturevalue(request.param)


CONCURRENCY = {"gateway": 1, "engine": 8, "kvcache": 4}  # the engine batches: 8 at a time cut its wall time


def _report(failures: list[str], total: int) -> None:
    assert not failures, f"{len(failures)} of {total} cases broke the rule:\n" + "\n".join(failures[:40])


# -- 1. the OpenAPI schemas ----------------------------------------------------------------------------

EXAMPLES = {"gateway": (45, 8), "engine": (12, 3), "kvcache": (60, 8)}  # per (body operation, other) and mode


def _schema(surface: Surface) -> dict:
    if surface.asgi is not None:
        return surface.asgi.openapi()
    return httpx.get(surface.url + "/openapi.json", timeout=10).json()


def _header_pairs(headers: dict) -> list[tuple[bytes, bytes]]:
    """Generated headers as bytes; names cut to token characters, values without CR, LF or NUL
    (what no HTTP client can send: the header cases below send the rest raw)."""
    pairs = []
    for name, value in headers.items():
        clean = "".join(c for c in str(name) if c.isascii() and (c.isalnum() or c in "-_!#$%&'*+.^`|~"))
        text = "".join(c for c in str(value) if c not in "\r\n\x00")
        if clean and clean.lower() not in ("content-length", "host", "transfer-encoding", "connection"):
            pairs.append((clean.encode(), text.encode("utf-8")))
    return pairs


def test_schema_fuzz(surface):
    """Schemathesis' strategies for every operation of the surface's own OpenAPI document, in its
    positive and negative modes; a third of the bodies get the served model name (and the
    gateway's requests a valid key), so they reach past the model check."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(_schema(surface))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= len(surface.body_paths)
    model = next(iter(surface.templates.values()))["model"]
    per_body, per_other = EXAMPLES[surface.name]
    sent: list[str] = []
    failures: list[str] = []

    def fuzz(operation, mode) -> None:
        path = operation.path
        n = per_body if path in surface.body_paths else per_other

        @settings(max_examples=n, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                         HealthCheck.data_too_large])  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=mode), twist=st.integers(0, 2))
        def call(case, twist):
            kw = case.as_transport_kwargs(base_url="http://fuzz")
            headers = _header_pairs(kw.get("headers") or {})
            if "json" in kw:
                body = kw["json"]
                if twist and isinstance(body, dict):
                    body = {**body, "model": model}
                content = json.dumps(body).encode()
                headers.append((b"content-type", b"application/json"))
            elif kw.get("data") is not None:
                data = kw["data"]
                content = data if isinstance(data, bytes) else str(data).encode()
            else:
                content = None
            if surface.name == "gateway" and twist:
                headers = [(k, v) for k, v in headers if k.lower() != b"authorization"]
            sent.append(operation.label)
            try:
                surface.send("schema " + mode.value, kw["method"], path, content=content, headers=headers,
                             params=kw.get("params") or None, default_headers=bool(twist))  # fmt: skip
            except BadAnswer as exc:  # collected, not raised: every bad answer of the run, no shrinking
                failures.append(str(exc))

        call()

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode)
            except Unsatisfiable:  # nothing to break: a GET without parameters in negative mode
                assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET", operation.label
    assert len(sent) >= len(operations) * 2
    _report(failures, len(sent))


# -- 2. invalid Unicode ----------------------------------------------------------------------------------


def test_invalid_unicode(surface):
    """A lone surrogate escape or bytes that are not UTF-8 in every string of a valid body, in a key,
    outside strings; a BOM; UTF-16. And valid text that is not ASCII (CJK, an emoji, U+2028, DEL,
    a zero-width space) in every string and as the request id, which ends up in HTTP headers."""
    cases = [c for path in surface.body_paths for c in invalid_unicode_cases(path, surface.templates[path])]
    failures = check_all(surface, "invalid unicode", cases, concurrency=CONCURRENCY[surface.name])
    _report(failures, len(cases))


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(code=st.integers(0xD800, 0xDFFF), around=st.text(max_size=8), where=st.integers(0, 50))
def _unicode_example(surface, code, around, where):
    path = surface.body_paths[where % len(surface.body_paths)]
    template = surface.templates[path]
    strings = [k for k, v in template.items() if isinstance(v, str)]
    key = strings[where % len(strings)]
    body = {**template, key: around + chr(code) + around}
    surface.post_json("invalid unicode", path, json.dumps(body).encode())  # json.dumps escapes the surrogate


def test_invalid_unicode_hypothesis(surface):
    """Every lone surrogate, with text around it, in a string field of a valid body."""
    _unicode_example(surface)


# -- 3. huge and odd numbers -----------------------------------------------------------------------------

NUMERIC_FIELDS = {
    "/v1/chat/completions": [
        ("max_tokens",), ("max_completion_tokens",), ("n",), ("temperature",), ("top_p",), ("seed",),
        ("priority",), ("min_tokens",), ("top_k",), ("min_p",), ("presence_penalty",), ("frequency_penalty",),
        ("repetition_penalty",), ("top_logprobs",), ("logit_bias", "5"), ("stop_token_ids", 0),
        ("prompt_token_ids", 0), ("messages", 0, "content"), ("kv_transfer_params", "remote_port"),
    ],
    "/v1/completions": [
        ("max_tokens",), ("n",), ("best_of",), ("logprobs",), ("seed",), ("temperature",), ("top_p",),
        ("top_k",), ("min_tokens",), ("priority",), ("prompt", 0), ("prompt_token_ids", 0), ("stop_token_ids", 0),
        ("logit_bias", "5"),
    ],
    "/tokenize": [("prompt",), ("add_special_tokens",)],
    "/detokenize": [("tokens", 0), ("tokens",)],
    "/lookup": [("token_ids", 0), ("block_size",), ("token_ids",), ("cache_salt",)],
}  # fmt: skip
ODD_KEYS = ["1" + "0" * 30, "-" + "9" * 25, "18446744073709551616", "-1", "NaN"]


def test_huge_numbers(surface):
    """Every numeric field (and a few others) as -1, 0, 2**31, 2**63, 2**64, a 401-digit integer,
    1e308, 1e999, NaN, Infinity, a string, a boolean; logit_bias keys that overflow int64. On the
    gateway, for a capped tenant too."""
    cases = []
    for path in surface.body_paths:
        template = surface.templates[path]
        if path == "/v1/chat/completions" and surface.name == "engine":
            template = {**template, "logprobs": True}  # so top_logprobs is checked for its range
        for where in NUMERIC_FIELDS[path]:
            for token in NUMBER_TOKENS:
                label = f"{'.'.join(map(str, where))}={token[:20]}"
                cases.append((label, path, with_token(template, where, token), None))
        if "model" in template and path.startswith("/v1/"):
            for key in ODD_KEYS:
                body = json.dumps({**template, "logit_bias": {key: 1}}).encode()
                cases.append((f"logit_bias key {key[:20]}", path, body, None))
    if surface.name == "gateway":
        capped = {"content-type": "application/json", "authorization": f"Bearer {CAPPED_KEY}"}
        cases += [(f"capped {label}", path, body, capped) for label, path, body, _ in list(cases)]
    failures = check_all(surface, "huge numbers", cases, concurrency=CONCURRENCY[surface.name])
    _report(failures, len(cases))


# -- 4. deep nesting -------------------------------------------------------------------------------------


def test_deep_nesting(surface):
    """10,000-deep arrays and objects (and 500-deep, which Python's json still parses) as the whole
    body, as each field, as an extra field, and inside a chat message."""
    cases = [c for path in surface.body_paths for c in deep_cases(path, surface.templates[path])]
    failures = check_all(surface, "deep nesting", cases, concurrency=CONCURRENCY[surface.name])
    _report(failures, len(cases))


# -- 5. huge and many headers ----------------------------------------------------------------------------


def test_huge_headers(surface):
    """A 64 KiB header (a custom one, x-request-id, authorization, traceparent, content-type),
    2,000 headers, 2,000 x-request-ids, bytes that are not ASCII, bad trace context, lying
    Content-Lengths: over a raw socket to the real server, and in-process over ASGI too."""
    failures = []
    total = 0
    for path in (*surface.body_paths, "/health", "/v1/models"):
        template = surface.templates.get(path) or next(iter(surface.templates.values()))
        body = json.dumps(template).encode()
        method = "POST" if path in surface.body_paths else "GET"
        for label, extra in header_cases(body):
            pairs = [(b"content-type", b"application/json"), *extra]
            ways = ["raw"] + (["asgi"] if surface.asgi is not None else [])
            for way in ways:
                total += 1
                try:
                    if way == "raw":
                        surface.send_raw("huge headers", method, path, pairs, body if method == "POST" else b"")
                    elif not any(n == b"content-length" for n, _ in extra):  # ASGI: no wire to lie on
                        surface.send("huge headers", method, path, content=body if method == "POST" else None,
                                     headers=pairs)  # fmt: skip
                except BadAnswer as exc:
                    failures.append(f"[{label} via {way}] {exc}")
    _report(failures, total)
    # And the server still answers after all that.
    assert surface.send("huge headers", "GET", "/health", over_http=True).status_code == 200


# -- 6. wrong content types and bodies that are not JSON -------------------------------------------------


def test_wrong_content_types(surface):
    cases = []
    for path in surface.body_paths:
        for label, body, headers in content_type_cases(surface.templates[path]):
            cases.append((label, path, body, headers))
    failures = check_all(surface, "content types", cases, concurrency=CONCURRENCY[surface.name])
    # The same over the wire (a body with no Content-Type at all is only possible there).
    if surface.asgi is not None:
        for label, path, body, headers in cases:
            pairs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
            try:
                surface.send_raw("content types", "POST", path, pairs, body)
            except BadAnswer as exc:
                failures.append(f"[{label} raw] {exc}")
    _report(failures, len(cases) * (2 if surface.asgi is not None else 1))


# -- 7. slow bodies --------------------------------------------------------------------------------------


class _Nothing:
    def labels(self, *args, **kwargs):
        return self

    def inc(self, *args, **kwargs):
        pass


def _engine_app_without_core():
    """The engine's real app and middleware over a stub core: enough for requests whose bodies never
    arrive (no route runs before the body guard has the whole body)."""
    from kvharbor.engine.serve.api_server import ServerState, build_app

    core = SimpleNamespace(info=SimpleNamespace(max_model_len=128, vocab_size=100), tokenizer=None,
                           model_name=ENGINE_MODEL, load=SimpleNamespace(lora_adapters={}), alive=True)  # fmt: skip
    state = ServerState(core, SimpleNamespace(requests=_Nothing()), "fuzz", 1 << 20)
    return build_app(state)


SLOW_APPS = {
    "gateway": lambda: build_gateway()[0],
    "engine": _engine_app_without_core,
    "kvcache": lambda: build_kvcache("redis://127.0.0.1:1/0"),  # never reached: the body never arrives
}
SLOW_PATHS = {"gateway": "/v1/chat/completions", "engine": "/v1/chat/completions", "kvcache": "/lookup"}
SLOW_TEMPLATES = {"gateway": chat_template("m"), "engine": chat_template(ENGINE_MODEL), "kvcache": lookup_template()}


@pytest.mark.parametrize("name", ["gateway", "engine", "kvcache"])
def test_slow_body(loop, monkeypatch, name):
    """A client that declares a body and then sends a third of it and stops ("stall"), or sends one
    byte every 0.2 s and never the last ("drip"), must get an answer (408, say) or a closed
    connection within a bound: it must not hold a connection and a coroutine forever. The read
    timeout is set to SLOW_BODY_TIMEOUT_S through common/http_errors.py's BODY_READ_TIMEOUT_S (the
    proposed fix; uvicorn itself has no body-read timeout). Both patterns run at once."""
    import asyncio

    from kvharbor.common import http_errors

    monkeypatch.setattr(http_errors, "BODY_READ_TIMEOUT_S", SLOW_BODY_TIMEOUT_S, raising=False)
    server = UvicornInLoop(loop, SLOW_APPS[name]())
    try:
        body = json.dumps(SLOW_TEMPLATES[name]).encode()
        headers = {"content-type": "application/json", "authorization": f"Bearer {GATEWAY_KEY}"}
        path = SLOW_PATHS[name]

        async def both():
            return await asyncio.gather(
                *(slow_body(server.url, path, headers, body, p, SLOW_BODY_BOUND_S) for p in ("stall", "drip"))
            )

        results = dict(zip(("stall", "drip"), loop.run(both(), SLOW_BODY_BOUND_S + 10), strict=True))
        for status, _took in results.values():
            code = status.split()[1] if status and status.startswith("HTTP/") else status or "hang"
            TALLY.count(name, "slow body", code)
        hung = [p for p, (_, took) in results.items() if took is None]
        assert not hung, (
            f"{name}: {' and '.join(hung)} bodies held their connections for {SLOW_BODY_BOUND_S:.0f}s without an "
            f"answer (no body-read timeout); answers: {results}"
        )
        for status, _ in results.values():
            if status and status.startswith("HTTP/"):
                code = int(status.split()[1])
                assert code < 500 or code == 503, status
        # The server still serves others.
        resp = loop.run(httpx.AsyncClient().get(server.url + "/health", timeout=5), 10)
        assert resp.status_code == 200
    finally:
        server.close()


@pytest.mark.slow
def test_one_bad_request_fails_no_other_in_its_batch(loop, engine):
    """Sampling options that the models accept but that make a NaN distribution (top_p or
    repetition_penalty of 5e-324) must fail at most their own request, never the requests that
    share its engine step (other tenants' ones)."""
    import asyncio

    template = {**chat_template(ENGINE_MODEL), "max_tokens": 40, "ignore_eos": True}
    poisons = [{"top_p": 5e-324}, {"repetition_penalty": 5e-324}]

    async def batch(poison: dict) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:

            async def late():
                await asyncio.sleep(0.3)  # arrives while the others decode: it joins their steps
                return await client.post("/v1/chat/completions", json={**template, **poison, "max_tokens": 2})

            others = [client.post("/v1/chat/completions", json={**template, "seed": i}) for i in range(4)]
            answers = await asyncio.gather(*others, late())
            return [(r.status_code, r.text[:200]) for r in answers]

    for poison in poisons:
        answers = loop.run(batch(poison), 60)
        for status, _ in answers:
            TALLY.count("engine", "poisoned batch", status)
        innocent = answers[:-1]
        assert all(status == 200 for status, _ in innocent), (poison, innocent)
        assert answers[-1][0] < 500, (poison, answers[-1])


# -- after all that --------------------------------------------------------------------------------------


def test_still_serves_after_the_fuzz(surface):
    """A valid request still gets a 200, and the engine holds no request and no KV block: nothing
    the fuzz sent leaked a request (its in-flight count would hold a drain for --drain-timeout)."""
    path = surface.body_paths[0]
    assert surface.post_json("after", path, surface.templates[path]).status_code == 200
    if surface.name == "engine":
        deadline = time.monotonic() + 10
        while True:
            load = httpx.get(surface.url + "/load", timeout=5).json()
            if load["in_flight"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert load["in_flight"] == 0, f"the engine still counts {load['in_flight']} requests in flight: {load}"
        assert load["kv_blocks_free"] == load["kv_blocks_total"], load


@pytest.mark.slow
def test_gateway_in_front_of_the_real_engine(loop, engine):
    """The gateway's numeric and request-id cases against the real engine (the gateway forwards
    what it does not check): still no 5xx without Retry-After, and, since an engine's 5xx counts as
    its failure, no engine ejected by what one tenant sent."""
    from kvharbor.gateway.engines import EnginePool

    app, _ = build_gateway(engine_urls=[engine.url], model=ENGINE_MODEL)
    gw = Surface("gw+engine", loop, "", asgi=app, headers={"authorization": f"Bearer {GATEWAY_KEY}"})
    template = chat_template(ENGINE_MODEL)
    cases = []
    for where in NUMERIC_FIELDS["/v1/chat/completions"]:
        for token in ("-1", str(2**63), str(2**64), str(-(2**63) - 1), "1" + "0" * 400, "1e999", "NaN", "5e-324"):
            cases.append((f"{where[0]}={token[:20]}", "/v1/chat/completions", with_token(template, where, token), None))
    for i, rid in enumerate(["\u65e5\u672c", "caf\xe9", "ok"]):
        cases.append((f"request_id {rid!r}", "/v1/chat/completions",
                      json.dumps({**template, "request_id": f"{rid}-{i}"}).encode(), None))  # fmt: skip
    try:
        failures = check_all(gw, "via gateway", cases, concurrency=4)
    finally:
        gw.close()
        loop.run(app.state.fuzz_http.aclose(), 10)
    pool: EnginePool = app.state.fuzz_pool
    ejected = [e.url for e in pool.all(ENGINE_MODEL) if not e.routable]
    _report(failures, len(cases))
    assert not ejected, f"the gateway ejected {ejected} after one tenant's bad numbers"
