"""Bad input gets the right 4xx in OpenAI's error shape, never a 500, also under fuzzing.
The server runs a random-weight tiny model with SmolLM2's tokenizer: fast, and answers don't matter."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import EngineServerProcess

pytestmark = pytest.mark.slow  # a real `kvharbor serve`

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_chat_model):
    args = (
        "--model",
        str(tiny_chat_model),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--num-kv-blocks",
        "64",
        "--max-n",
        "4",
        "--max-body-bytes",
        "20000",
        "--log-level",
        "warning",
    )
    with EngineServerProcess(tmp_path_factory.mktemp("serve"), *args) as proc:
        yield proc


def post(server, path, body, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60, **kw
    )


def assert_openai_error(resp, status, match=""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert match.lower() in err["message"].lower(), err["message"]
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "status", "match"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, ""),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "n": "two"}, 400, "n"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-17"}, 404, "not served here"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "n": 5}, 400, "limit of 4"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "logprobs"),
        ("/v1/chat/completions", {**CHAT, "kv_prefix_source": "shared"}, 400, "shared block store"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 300}]}, 400, "context"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "outside the vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, ""),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/detokenize", {"model": MODEL, "tokens": [10**7]}, 400, "vocabulary"),
        ("/tokenize", {"model": MODEL}, 400, "prompt or messages"),
    ],
)
def test_bad_input_gets_the_right_4xx(server, path, body, status, match):
    assert_openai_error(post(server, path, body), status, match)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(["chat", "stop", "model", "prompt", "prompt_list", "tokenize", "bytes"]),
    st.integers(0xD800, 0xDFFF),
    st.text(max_size=6),
)
def test_text_that_is_not_unicode_gets_400_never_500(server, where, code, around):
    """The whole class: a lone surrogate escape in any string field, or bytes that are not UTF-8.
    (It was a 500 from both the engine and the gateway.)"""
    bad = around + chr(code) + around
    path, body = {
        "chat": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": bad}]}),
        "stop": ("/v1/chat/completions", {**CHAT, "stop": ["ok", bad]}),
        "model": ("/v1/chat/completions", {**CHAT, "model": bad}),
        "prompt": ("/v1/completions", {"model": MODEL, "prompt": bad, "max_tokens": 2}),
        "prompt_list": ("/v1/completions", {"model": MODEL, "prompt": ["fine", bad], "max_tokens": 2}),
        "tokenize": ("/tokenize", {"model": MODEL, "prompt": bad}),
        # Not UTF-8 at all (0xED 0xA0 0x80 would be a surrogate encoded as if it were a character).
        "bytes": ("/v1/completions", b'{"model": "tiny-chat", "prompt": "' + bytes([0xFF, 0xED, 0xA0, 0x80]) + b'"}'),
    }[where]
    err = assert_openai_error(post(server, path, body), 400, "UTF")
    assert err["code"] == "invalid_unicode"


def test_oversized_bodies_get_413(server):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 30_000}]}
    assert_openai_error(post(server, "/v1/chat/completions", body), 413, "exceeds")
    # Without a Content-Length header (chunked upload), too.
    chunks = (b"x" * 5000 for _ in range(10))
    resp = httpx.post(server.url + "/v1/completions", content=chunks, timeout=30)
    assert_openai_error(resp, 413, "exceeds")


def test_unknown_routes_and_methods_are_openai_errors(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 405)


def test_the_server_still_serves_after_all_that(server):
    resp = post(server, "/v1/chat/completions", CHAT)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
    load = httpx.get(server.url + "/load").json()
    assert load["kv_blocks_free"] == load["kv_blocks_total"]


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=6,
)
_fields = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stream",
    "stream_options",
    "ignore_eos",
    "min_tokens",
    "top_k",
    "min_p",
    "prompt_token_ids",
    "priority",
    "request_id",
    "cache_salt",
    "echo",
    "presence_penalty",
    "tokens",
]
_good = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(-2, 40),
    "stream": st.booleans(),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "x"]), "content": st.one_of(st.text(max_size=30), _values)}
        ),
        max_size=2,
    ),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=5), _values),
    "n": st.integers(-1, 6),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
}
bodies = st.dictionaries(st.sampled_from(_fields), _values, max_size=8).flatmap(
    lambda d: st.fixed_dictionaries(
        {k: _good.get(k, st.just(v)) for k, v in d.items()} | {k: _good[k] for k in ("model",) if k not in d}
    )
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]), body=bodies)
def test_fuzzed_requests_never_get_a_500(server, path, body):
    resp = post(server, path, body)
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_schemathesis_finds_no_server_error(server):
    # Schemathesis' pytest plugin does not load under pytest 9, so its strategies run under plain hypothesis.
    import schemathesis

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    calls = []

    def fuzz(operation):
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def call(case):
            response = case.call(base_url=server.url, timeout=60)
            calls.append(response.status_code)
            assert response.status_code < 500, (operation.label, case.body, response.text)

        call()

    for operation in operations:
        fuzz(operation)
    assert len(calls) >= 9 * 5 and any(code == 200 for code in calls)


def test_the_serving_benchmark_measures_this_server(server, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import serve as serve_bench

    out = tmp_path / "bench.json"
    code = serve_bench.main(
        [
            "--url",
            server.url,
            "--model",
            MODEL,
            "--num-requests",
            "4",
            "--concurrency",
            "1,2",
            "--shared-prefix",
            "0,16",
            "--prompt-len",
            "24",
            "--output-len",
            "5",
            "--warmup",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    machine = result["machine"]
    assert machine["cpu_model"] and machine["cores"] >= 1 and "avx2" in machine["isa"]
    assert machine["dtype"] == "float32"  # the fixture's server runs --dtype float32
    assert [(r["shared_prefix"], r["concurrency"]) for r in result["runs"]] == [(0, 1), (0, 2), (16, 1), (16, 2)]
    for run in result["runs"]:
        s = run["summary"]
        assert s["errors"] == 0 and s["output_tok_s"] > 0 and s["ttft_p50_s"] > 0
        assert all(r["output_tokens"] == 5 and len(r["itls_s"]) >= 1 for r in run["requests"])
    with pytest.raises(SystemExit, match="loopback"):
        serve_bench.parse_args(["--url", "http://192.0.2.1:8000", "--model", MODEL])
