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


# -- migration: a stream whose engine fails mid-way goes on elsewhere ---------------------------------


def tok(text: str, ids: list[int], cid: str = "chatcmpl-A") -> str:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None, "token_ids": ids}
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return "data: " + json.dumps(chunk)


def role(cid: str) -> str:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    created = 9 if cid != "chatcmpl-A" else 1
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": "m", "choices": [choice]}
    return "data: " + json.dumps(chunk)


def finish(cid: str, reason: str = "length") -> str:
    chunk = {"id": cid, "object": "chat.completion.chunk", "created": 9, "model": "m",
             "choices": [{"index": 0, "delta": {}, "finish_reason": reason, "token_ids": []}]}  # fmt: skip
    return "data: " + json.dumps(chunk)


def usage(cid: str, prompt: int, completion: int) -> str:
    body = {"id": cid, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": prompt}}}  # fmt: skip
    return "data: " + json.dumps(body)


def _migrating_run(first: _Body, seconds: list[_Body], max_tokens: int | None = 20, limit: int = 2, **options):
    """Relay `first`; each migration opens the next of `seconds`. Returns (client chunks, opens, stats, debits)."""
    from kvharbor.gateway.proxy import EngineFailed
    from kvharbor.gateway.relay import Continuation

    opens: list[tuple[list[int], str]] = []
    delivered: list[str] = []
    debits: list[int] = []
    settled: list = []

    async def main():
        bodies = iter([first, *seconds])
        http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=next(bodies))))
        caller = EngineCaller(http, EnginePool(http), 1.0, 5.0, 10.0)
        engine = Engine("http://e", "m")
        stream = await caller.open_stream(engine, "/v1/chat/completions", {}, {})

        async def reopen(ids, failure, text):
            opens.append((list(ids), failure))
            delivered.append(text)
            if len(opens) > len(seconds):
                raise EngineFailed("no other engine")
            return await caller.open_stream(engine, "/v1/chat/completions", {}, {})

        async def debit(n):
            debits.append(n)

        async def settle(stats):
            settled.append(stats)

        continuation = Continuation(reopen, limit, max_tokens, 5, strip_token_ids=True)
        relay = StreamRelay(stream, "rid", True, debit, settle, continuation=continuation, **options)
        out = [line async for line in relay.lines()]
        await http.aclose()
        return out

    out = asyncio.run(main())
    chunks = [json.loads(line[6:]) for line in out if line.startswith("data: {")]
    assert out[-1] == "data: [DONE]\n\n"
    _migrating_run.delivered = delivered  # what each migration was told the client had
    return chunks, opens, settled[0], debits


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))


def test_a_stream_whose_engine_dies_goes_on_elsewhere_as_one_answer():
    first = _Body([role("chatcmpl-A"), *(tok(f"t{i} ", [i]) for i in range(5))], broken=True)
    second = _Body([role("chatcmpl-B"), *(tok(f"t{i} ", [i]) for i in range(5, 9)), finish("chatcmpl-B"),
                    usage("chatcmpl-B", 5 + 5, 4), "data: [DONE]"])  # fmt: skip
    chunks, opens, stats, debits = _migrating_run(first, [second])
    assert opens == [([0, 1, 2, 3, 4], "hard")]  # the prompt's continuation: what was streamed
    assert _migrating_run.delivered == ["t0 t1 t2 t3 t4 "]  # and the text the client has of it
    assert _text(chunks) == "".join(f"t{i} " for i in range(9))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert deltas.count({"role": "assistant", "content": ""}) == 1
    assert {c["id"] for c in chunks} == {"chatcmpl-A"} and {c["created"] for c in chunks} == {1}
    assert all("token_ids" not in ch for c in chunks for ch in c["choices"])  # the gateway's own ask: hidden
    (final,) = [c["usage"] for c in chunks if c.get("usage")]
    assert final["prompt_tokens"] == 5 and final["completion_tokens"] == 9 and final["total_tokens"] == 14
    assert final["prompt_tokens_details"]["cached_tokens"] == 5
    assert stats.migrations == 1 and stats.error is None and not stats.migration_failed
    assert sum(debits) == 9 and stats.tokens_seen == 9  # TPM counted once, for the whole answer
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []


def test_tokens_whose_text_had_not_reached_the_client_are_generated_again():
    pending = tok("", [7])  # a token whose bytes end mid-character: no text yet
    first = _Body([role("chatcmpl-A"), tok("a", [1]), pending], broken=True)
    second = _Body([role("chatcmpl-B"), tok("é", [7]), finish("chatcmpl-B"), "data: [DONE]"])
    chunks, opens, _, _ = _migrating_run(first, [second])
    assert opens == [([1], "hard")] and _text(chunks) == "aé"


def test_an_engine_that_reports_itself_unavailable_migrates_but_a_request_error_does_not():
    dead = 'data: {"error":{"message":"engine core died","type":"service_unavailable"}}'
    second = _Body([role("chatcmpl-B"), tok("b", [2]), finish("chatcmpl-B"), "data: [DONE]"])
    chunks, opens, stats, _ = _migrating_run(_Body([tok("a", [1]), dead, "data: [DONE]"]), [second])
    assert opens == [([1], "hard")] and _text(chunks) == "ab" and stats.error is None
    failed = 'data: {"error":{"message":"KV pool exhausted","type":"internal_error"}}'
    chunks, opens, stats, _ = _migrating_run(_Body([tok("a", [1]), failed, "data: [DONE]"]), [])
    assert opens == [] and chunks[-1]["error"]["message"] == "KV pool exhausted"


def test_an_engine_that_aborts_the_request_its_drain_timed_out_migrates():
    first = _Body([tok("a", [1]), finish("chatcmpl-A", "abort"), "data: [DONE]"])
    second = _Body([role("chatcmpl-B"), tok("b", [2]), finish("chatcmpl-B", "stop"), "data: [DONE]"])
    chunks, opens, _, _ = _migrating_run(first, [second])
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert opens == [([1], "hard")] and _text(chunks) == "ab" and "abort" not in reasons and reasons[-1] == "stop"


def test_a_stalled_engine_past_the_idle_timeout_migrates():
    first = _Body([tok("a", [1]), tok("b", [2])], pause={1: 3.0})
    second = _Body([role("chatcmpl-B"), tok("b", [2]), finish("chatcmpl-B"), "data: [DONE]"])
    chunks, opens, stats, _ = _migrating_run(first, [second], idle_s=0.2)
    assert opens == [([1], "stall")] and _text(chunks) == "ab" and first.closed and stats.timeout is None


def test_past_the_migration_limit_or_with_nowhere_to_go_the_stream_ends_with_an_error_event():
    first = _Body([tok("a", [1])], broken=True)
    again = _Body([role("chatcmpl-B"), tok("b", [2])], broken=True)
    chunks, opens, stats, _ = _migrating_run(first, [again], limit=1)
    assert len(opens) == 1 and _text(chunks) == "ab" and "broke" in chunks[-1]["error"]["message"]
    assert stats.migrations == 1 and stats.migration_failed
    chunks, opens, stats, _ = _migrating_run(_Body([tok("a", [1])], broken=True), [])
    assert len(opens) == 1 and "error" in chunks[-1] and stats.migration_failed and stats.migrations == 0


def test_an_engine_that_died_after_its_last_token_just_ends_the_answer():
    first = _Body([role("chatcmpl-A"), tok("a", [1]), tok("b", [2])], broken=True)
    chunks, opens, stats, _ = _migrating_run(first, [], max_tokens=2)
    assert opens == [] and _text(chunks) == "ab" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["id"] == "chatcmpl-A" and stats.error is None
    assert stats.finished_here and stats.migrations == 0  # no engine took it over: not a move


def test_the_continuation_request_carries_the_prompt_and_streamed_tokens_with_what_is_left():
    from types import SimpleNamespace

    from kvharbor.gateway.engine_body import continued_payload

    call = SimpleNamespace(prompts=[[1, 2, 3]], kind="completion", engine_rid="rid.abcd")
    sent = {"model": "m", "prompt": "x", "prompt_token_ids": [1, 2, 3], "max_tokens": 10, "min_tokens": 4,
            "echo": True, "seed": 7, "temperature": 0.7, "kv_transfer_params": {"remote_handle": "h"}}  # fmt: skip
    out = continued_payload(sent, call, [9, 9, 9], 10, 1)
    assert out["prompt_token_ids"] == [1, 2, 3, 9, 9, 9] and "prompt" not in out
    assert out["max_tokens"] == 7 and out["min_tokens"] == 1 and out["echo"] is False
    assert out["seed"] == 7 and out["temperature"] == 0.7 and out["return_token_ids"] is True
    assert "kv_transfer_params" not in out and out["request_id"] == "rid.abcd.m1"
    assert sent["max_tokens"] == 10  # the first request's payload is left as it was
    chat = continued_payload({"max_completion_tokens": 5}, SimpleNamespace(prompts=[[1]], kind="chat",
                             engine_rid="r"), [4], 5, 2)  # fmt: skip
    assert chat["max_tokens"] == 4 and "max_completion_tokens" not in chat and "echo" not in chat
    assert "max_tokens" not in continued_payload({}, SimpleNamespace(prompts=[[1]], kind="chat", engine_rid="r"),
                                                 [4], None, 1)  # fmt: skip


def _call_with_stop(stop):
    from types import SimpleNamespace

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            pieces = {1: "The ", 2: "E", 3: "N", 4: "<s>", 5: "\ufffd"}  # 5: a character's first byte
            return "".join(pieces[i] for i in ids if not (skip_special_tokens and i == 4))

    body = SimpleNamespace(stop=stop, skip_special_tokens=True)
    model = SimpleNamespace(tokenizer=Tok())
    return SimpleNamespace(prompts=[[7]], kind="chat", engine_rid="r", body=body, model=model)


def test_a_continuation_opens_with_the_text_the_failed_engine_held_back():
    from kvharbor.gateway.engine_body import continued_payload

    out = continued_payload({}, _call_with_stop(["END"]), [1, 2, 3], None, 1, "The ")
    assert out["continued_text"] == "EN" and out["prompt_token_ids"] == [7, 1, 2, 3]
    assert "continued_text" not in continued_payload({}, _call_with_stop(["END"]), [1, 2, 3], None, 1, "The EN")


def test_a_completions_continuation_places_its_logprob_offsets_after_the_text_the_client_has():
    from types import SimpleNamespace

    from kvharbor.gateway.engine_body import continued_payload

    call = SimpleNamespace(prompts=[[7]], kind="completion", engine_rid="r", body=SimpleNamespace(stop=None),
                           model=SimpleNamespace(tokenizer=None))  # fmt: skip
    assert continued_payload({}, call, [1, 2], None, 1, "Paris, th")["text_offset"] == 9  # no echo: logprobs refuse it
    chat = continued_payload({}, _call_with_stop(["END"]), [1, 2, 3], None, 1, "The ")
    assert "text_offset" not in chat  # chat logprobs carry no offsets


def test_the_text_a_failed_engine_held_back_is_what_the_continuation_opens_with():
    """gateway/engine_body.py's held_text: the streamed tokens' text beyond what the client has (the engine
    held it back: it could start a stop string); nothing without stop strings or when the decoded
    text does not extend the delivered one."""
    from kvharbor.gateway.engine_body import held_text

    assert held_text(_call_with_stop(["END"]), [1, 2, 3], "The ") == "EN"
    assert held_text(_call_with_stop(["END"]), [1, 2, 3, 4], "The ") == "EN"  # special tokens skipped, as engines do
    assert held_text(_call_with_stop(["END"]), [1, 2, 3], "The EN") == ""
    assert held_text(_call_with_stop(["END"]), [1, 2, 3, 5], "The ") == "EN"  # not an unfinished character
    assert held_text(_call_with_stop(None), [1, 2, 3], "The ") == ""  # no stop string: nothing is held back
    assert held_text(_call_with_stop(["END"]), [1, 2, 3], "Other") == ""  # not an extension: as before
