"""The gateway's stream relay (gateway/sse.py, gateway/relay.py): each engine SSE line parsed
once and told apart by its fields; usage, TPM and the settle-once bookkeeping; a stream that
breaks after its first token."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvharbor.gateway import sse
from kvharbor.gateway.engines import Engine, EnginePool
from kvharbor.gateway.proxy import EngineCaller
from kvharbor.gateway.relay import StreamRelay


def token(text: str) -> str:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return "data: " + json.dumps(chunk)


ROLE = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}'
FINISH = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
USAGE = 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":20,"total_tokens":25}}'


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (token("Hi"), sse.TOKEN),
        ('data: {"choices":[{"index":0,"text":"Hi","finish_reason":null}]}', sse.TOKEN),  # /v1/completions
        (ROLE, sse.OTHER),
        (FINISH, sse.OTHER),
        (USAGE, sse.USAGE),
        ('data:{"usage":{"completion_tokens":3}}', sse.USAGE),  # no space, no choices key
        ('data: {"error":{"message":"boom","type":"internal_error"}}', sse.ERROR),
        ('data: {"object":"error","error":{"message":"boom"}}', sse.ERROR),  # another key first
        ('data: {"choices":[{"delta":{"content":"{\\"error\\": 1}"}}]}', sse.TOKEN),  # "error" in the text
        ('data: {"choices":[{"delta":{"content":"the usage is"}}]}', sse.TOKEN),  # "usage" in the text
        ("data: [DONE]", sse.DONE),
        ("data: {not json", sse.OTHER),
        ("data: [1, 2]", sse.OTHER),
        ("", sse.OTHER),
        (": keep-alive", sse.OTHER),
    ],
)
def test_each_line_is_told_apart_by_its_fields(line, kind):
    event = sse.parse(line)
    assert event.kind == kind and event.line == line


def test_an_error_events_message_is_read_from_its_fields():
    assert sse.parse('data: {"error":{"message":"engine died"}}').error_message == "engine died"
    assert sse.parse('data: {"error":"plain"}').error_message == "plain"
    assert "error event" in sse.parse('data: {"error":{}}').error_message


class _Body(httpx.AsyncByteStream):
    """An engine's SSE body, line by line; `broken`: the connection drops after it."""

    def __init__(self, lines: list[str], broken: bool = False) -> None:
        self.lines, self.broken = lines, broken

    async def __aiter__(self):
        for line in self.lines:
            yield (line + "\n\n").encode()
            await asyncio.sleep(0)
        if self.broken:
            raise httpx.ReadError("connection reset")


def _relay_run(lines: list[str], include_usage: bool, broken: bool = False):
    """Open the stream through EngineCaller, relay it; returns (client lines, debits, settled stats)."""
    debits: list[int] = []
    settled: list = []

    async def main():
        engine = httpx.MockTransport(lambda r: httpx.Response(200, stream=_Body(lines, broken)))
        http = httpx.AsyncClient(transport=engine)
        caller = EngineCaller(http, EnginePool(http), 1.0, 5.0, 10.0)
        stream = await caller.open_stream(Engine("http://e", "m"), "/v1/chat/completions", {}, {})

        async def debit(n):
            debits.append(n)

        async def settle(stats):
            settled.append(stats)

        relay = StreamRelay(stream, "rid-1", include_usage, debit, settle)
        out = [line async for line in relay.lines()]
        await relay.close()  # again: settles once
        await http.aclose()
        return out

    return asyncio.run(main()), debits, settled


def test_a_stream_is_relayed_parsed_once_with_usage_tpm_and_one_settle(monkeypatch):
    lines = [ROLE, *(token(f"t{i}") for i in range(20)), FINISH, USAGE, "data: [DONE]"]
    calls = []
    real = sse.json.loads
    monkeypatch.setattr(sse.json, "loads", lambda s: calls.append(s) or real(s))
    out, debits, settled = _relay_run(lines, include_usage=False)
    assert len(calls) == len(lines) - 1  # every data line once; [DONE] needs no JSON
    assert out == [line + "\n\n" for line in lines if line != USAGE]  # the gateway's own usage ask is hidden
    (stats,) = settled
    assert stats.tokens_seen == 20 and len(stats.chunk_times) == 19 and stats.first_token is not None
    assert stats.usage["completion_tokens"] == 20 and stats.error is None
    assert debits == [16, 4]  # a batch of 16 as they flowed, then the rest from usage
    out, _, _ = _relay_run(lines, include_usage=True)
    assert USAGE + "\n\n" in out


def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error_event(monkeypatch):
    out, debits, settled = _relay_run([ROLE, token("a"), token("b")], include_usage=False, broken=True)
    assert out[:3] == [ROLE + "\n\n", token("a") + "\n\n", token("b") + "\n\n"]
    assert sse.parse(out[3].strip()).kind == sse.ERROR and out[4] == "data: [DONE]\n\n"
    (stats,) = settled
    assert "broke" in stats.error and stats.tokens_seen == 2
    assert debits == [2]  # no usage came: the tokens seen are what the tenant pays


def test_an_engine_error_event_after_the_first_token_is_relayed_and_recorded():
    error = 'data: {"error":{"message":"KV pool exhausted","type":"internal_error"}}'
    out, _, settled = _relay_run([token("a"), error, "data: [DONE]"], include_usage=False)
    assert out[1] == error + "\n\n" and settled[0].error == "KV pool exhausted"



@pytest.mark.parametrize("stream", [True, False])
def test_an_engine_that_lost_the_model_is_retried_elsewhere_but_a_clients_404_is_not(stream):
    """An engine answering 404 model_not_found was routed to because its /load listed the model
    (a LoRA adapter it has since unloaded): EngineFailed, so another engine is tried. Other 4xx
    stay the client's error."""
    from kvharbor.common.openai_api import APIError
    from kvharbor.gateway.proxy import EngineFailed

    def answer(code):
        body = {"error": {"message": "model 'sql' is not served here", "type": "invalid_request_error",
                          "param": "model", "code": code}}  # fmt: skip
        return httpx.MockTransport(lambda r: httpx.Response(404 if code else 400, json=body))

    async def call(code):
        http = httpx.AsyncClient(transport=answer(code))
        caller = EngineCaller(http, EnginePool(http), 1.0, 5.0, 10.0)
        try:
            if stream:
                return await caller.open_stream(Engine("http://e", "m"), "/v1/chat/completions", {}, {})
            return await caller.call(Engine("http://e", "m"), "/v1/chat/completions", {}, {})
        finally:
            await http.aclose()

    with pytest.raises(EngineFailed, match="not served here"):
        asyncio.run(call("model_not_found"))
    with pytest.raises(APIError) as bad:
        asyncio.run(call(None))
    assert bad.value.status == 400
