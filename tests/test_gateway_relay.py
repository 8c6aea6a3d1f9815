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

    def __init__(self, lines: list[str], broken: bool = False, pause: dict[int, float] | None = None) -> None:
        self.lines, self.broken, self.pause = lines, broken, pause or {}
        self.closed = False

    async def __aiter__(self):
        for i, line in enumerate(self.lines):
            await asyncio.sleep(self.pause.get(i, 0))  # before line i
            yield (line + "\n\n").encode()
        if self.broken:
            raise httpx.ReadError("connection reset")

    async def aclose(self) -> None:
        self.closed = True  # the engine sees the disconnect: it aborts the request


def _relay_run(lines: list[str], include_usage: bool, broken: bool = False, body: _Body | None = None, **relay):
    """Open the stream through EngineCaller, relay it; returns (client lines, debits, settled stats)."""
    debits: list[int] = []
    settled: list = []
    relay_options = relay

    async def main():
        engine = httpx.MockTransport(lambda r: httpx.Response(200, stream=body or _Body(lines, broken)))
        http = httpx.AsyncClient(transport=engine)
        caller = EngineCaller(http, EnginePool(http), 1.0, 5.0, 10.0)
        stream = await caller.open_stream(Engine("http://e", "m"), "/v1/chat/completions", {}, {})

        async def debit(n):
            debits.append(n)

        async def settle(stats):
            settled.append(stats)

        relay = StreamRelay(stream, "rid-1", include_usage, debit, settle, **relay_options)
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


def test_a_stream_idle_past_its_timeout_ends_with_an_error_event_and_closes_the_engine():
    body = _Body([ROLE, token("a"), token("b"), "data: [DONE]"], pause={2: 2.0})  # then 2 s of silence
    out, debits, settled = _relay_run([], include_usage=False, body=body, idle_s=0.2)
    assert out[:2] == [ROLE + "\n\n", token("a") + "\n\n"]
    error = json.loads(out[2].strip()[len("data: "):])["error"]
    assert error["code"] == "stream_idle_timeout" and "no token for 0.2 s" in error["message"]
    assert out[3:] == ["data: [DONE]\n\n"]
    assert settled[0].timeout == "idle" and body.closed  # the engine's connection closed: it aborts
    assert debits == [1]


def test_a_stream_past_its_deadline_ends_although_tokens_still_flow():
    lines = [token(f"t{i}") for i in range(40)] + ["data: [DONE]"]
    body = _Body(lines, pause={i: 0.02 for i in range(1, 41)})  # ~0.8 s in all
    out, _, settled = _relay_run([], include_usage=False, body=body, deadline_s=0.25, idle_s=5.0)
    assert 3 <= len(out) - 2 < 40  # some tokens, then the deadline
    assert json.loads(out[-2].strip()[len("data: "):])["error"]["code"] == "stream_deadline_timeout"
    assert settled[0].timeout == "deadline" and body.closed


def test_a_long_stream_renews_its_slot_while_it_lives():
    renewals = []

    async def renew():
        renewals.append(1)

    lines = [token(f"t{i}") for i in range(12)] + ["data: [DONE]"]
    body = _Body(lines, pause={i: 0.03 for i in range(1, 13)})
    out, _, settled = _relay_run([], include_usage=False, body=body, renew=renew, renew_every_s=0.08)
    assert len(out) == 13 and settled[0].timeout is None
    assert 2 <= len(renewals) <= 6



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
