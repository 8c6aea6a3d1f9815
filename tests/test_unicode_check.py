"""Bodies that are not Unicode text get a 400 that names where, on every HTTP surface (the check
itself here; the real engine, gateway and KV cache service in their own test files)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.common.http_errors import BodyGuardMiddleware
from kvharbor.common.unicode_check import lone_surrogate_path, unicode_problem

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
JSON_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def body(doc) -> bytes:
    return json.dumps(doc).encode()  # ensure_ascii: a surrogate travels as its \\uXXXX escape


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages.0.content"),
        (b'{"prompt": "\\udc00"}', "prompt"),  # a low surrogate alone
        (b'{"prompt": "\\udc00\\ud800"}', "prompt"),  # the pair in the wrong order
        (b'{"stop": ["ok", "\\ud83d"]}', "stop.1"),  # half an emoji
        (b'{"model": "m", "\\ud800": 1}', "a key"),
        (b'"\\udfff"', None),
    ],
)
def test_lone_surrogates_are_found_and_located(raw, where):
    problem = unicode_problem(raw)
    assert problem is not None and "lone UTF-16 surrogate" in problem[0]
    assert problem[1] == where


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud83d\\ude00 paired: an emoji"}',
        '{"prompt": "\U0001f600 as UTF-8"}'.encode(),
        b'{"prompt": "a backslash then text: \\\\ud800"}',  # an escaped backslash, not an escape
        b'{"prompt": "plain"}',
        b"not json at all \\ud800",  # not JSON: the app's own parser answers
        b"[" * 5000 + b'"\\ud800"' + b"]" * 5000,  # too deep for json.loads: left to the app
    ],
)
def test_valid_text_and_non_json_pass(raw):
    assert unicode_problem(raw) is None


@pytest.mark.parametrize("raw", [b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xc3"}', b"\xed\xa0\x80"])
def test_bytes_that_are_not_utf8_are_refused(raw):
    problem = unicode_problem(raw)
    assert problem is not None and "not valid UTF-8" in problem[0] and problem[1] is None


def test_deep_nesting_does_not_overflow_the_walk():
    doc: object = "\ud800"
    for _ in range(20_000):
        doc = [doc]
    assert lone_surrogate_path(doc) == ".".join(["0"] * 20_000)


@settings(max_examples=300, deadline=None)
@given(JSON_DOCS, SURROGATES, st.randoms(use_true_random=False))
def test_a_surrogate_anywhere_in_any_document_is_found(doc, bad, rng):
    assert unicode_problem(body(doc)) is None  # the document without it is fine
    wrapped = {"payload": doc, "spot": [rng.choice(["", "x"]) + bad + rng.choice(["", "y"])]}
    problem = unicode_problem(body(wrapped))
    assert problem is not None and problem[1] == "spot.0"


def test_the_middleware_answers_400_and_lets_good_bodies_through():
    seen: list[bytes] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = BodyGuardMiddleware(app, limit=10_000, prefixes=("/v1/",))

    async def main():
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            bad = await client.post("/v1/chat/completions", content=b'{"messages": [{"content": "\\ud800"}]}')
            good = await client.post("/v1/chat/completions", content=b'{"messages": [{"content": "fine"}]}')
            other = await client.post("/health", content=b'"\\ud800"')  # outside the guarded prefixes
        return bad, good, other

    bad, good, other = asyncio.run(main())
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["code"] == "invalid_unicode" and error["param"] == "messages.0.content"
    assert good.status_code == 200 and seen[0] == b'{"messages": [{"content": "fine"}]}'
    assert other.status_code == 200
