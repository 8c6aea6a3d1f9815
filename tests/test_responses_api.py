"""The Responses API through the gateway's app (in-process over httpx's ASGI transport), with the
real `openai` SDK as the client and scripted chat engines behind httpx.MockTransport: the
translation to chat, the output items, the streamed event sequence (parsed by the SDK's own
event types), the store's tenant isolation, eviction, and the 400s naming their field."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest
from gateway_state import gateway_state, polled_pool
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from kvharbor.common.model_files import load_tokenizer
from kvharbor.gateway.app import build_app
from kvharbor.gateway.response_store import MemoryResponseStore
from kvharbor.gateway.tenants import hash_key

MODEL = "resp-m"
TENANTS = {"tenants": [{"name": "acme", "api_keys": [hash_key("sk-acme")]},
                       {"name": "other", "api_keys": [hash_key("sk-other")]}]}  # fmt: skip
USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[1]


class ScriptedEngine:
    """Answers each chat with the next scripted answer, as a kvharbor engine would (JSON, or SSE
    for a stream): ("text", s), ("tool", name, arguments), ("cut", s) (max_tokens reached), or
    ("broken", s) (an error event after s). Records every body it gets."""

    def __init__(self) -> None:
        self.script: list[tuple] = []
        self.bodies: list[dict[str, Any]] = []
        self.hosts: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.hosts.append(request.url.host)
        kind, *args = self.script.pop(0) if self.script else ("text", "Hello there")
        if body.get("stream"):
            return httpx.Response(200, content=_sse(kind, args).encode(), headers={"content-type": "text/event-stream"})
        message: dict[str, Any] = {"role": "assistant", "content": args[-1] if kind != "tool" else None}
        if kind == "think":
            message["reasoning"] = args[0]
        if kind == "tool":
            fn = {"name": args[0], "arguments": args[1]}
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": fn}]
        finish = {"tool": "tool_calls", "cut": "length"}.get(kind, "stop")
        answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL, "usage": USAGE,
                  "choices": [{"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip
        return httpx.Response(200, json=answer)


def _sse(kind: str, args: list) -> str:
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip

    chunks: list[dict] = [chunk({"role": "assistant", "content": ""})]
    if kind == "tool":
        name, arguments = args
        chunks.append(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))  # fmt: skip
        half = len(arguments) // 2
        for part in (arguments[:half], arguments[half:]):
            chunks.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}))
        chunks.append(chunk({}, "tool_calls"))
    else:
        if kind == "think":
            chunks += [chunk({"reasoning": part}) for part in (args[0][:3], args[0][3:])]
        for word in args[-1].split(" "):
            chunks.append(chunk({"content": word + " "}))
        if kind == "broken":
            chunks.append({"error": {"message": "the engine failed", "type": "server_error", "code": "engine_error"}})
        else:
            chunks.append(chunk({}, "length" if kind == "cut" else "stop"))
    chunks.append({"id": "c", "choices": [], "usage": USAGE})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


class Gateway:
    """The app in front of scripted engines (one by default); `client(key)` is an AsyncOpenAI on it."""

    def __init__(self, tokenizer, store: Any = None, engines: tuple[str, ...] = ("http://a",),
                 index: Any = None) -> None:  # fmt: skip
        self.engine = ScriptedEngine()
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self.engine))
        self.pool = polled_pool(self.http, MODEL, list(engines))
        self.state = gateway_state(self.http, self.pool, {MODEL: tokenizer}, TENANTS, index)
        if store is not None:
            self.state.responses = store
        self.transport = httpx.ASGITransport(app=build_app(self.state))

    def client(self, key: str = "sk-acme") -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=self.transport, base_url="http://gw")
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=http, max_retries=0)

    def raw(self, key: str = "sk-acme") -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport, base_url="http://gw",
                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def run(coro):
    return asyncio.run(coro)


def test_a_response_is_the_engines_chat_answer_and_is_stored_for_its_tenant(tokenizer):
    gw = Gateway(tokenizer)

    async def main():
        client = gw.client()
        first = await client.responses.create(model=MODEL, input="Hi!", instructions="Be brief.",
                                              max_output_tokens=8, temperature=0, metadata={"k": "v"})  # fmt: skip
        got = await client.responses.retrieve(first.id)
        items = await client.responses.input_items.list(first.id)
        return first, got, items

    first, got, items = run(main())
    assert first.status == "completed" and first.output_text == "Hello there"
    assert first.output[0].type == "message" and first.output[0].content[0].type == "output_text"
    assert first.usage.input_tokens == 40 and first.usage.input_tokens_details.cached_tokens == 32
    assert first.usage.output_tokens == 3 and first.metadata == {"k": "v"} and first.max_output_tokens == 8
    assert got.id == first.id and got.output_text == "Hello there"
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Hi!"
    sent = gw.engine.bodies[0]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert sent["max_completion_tokens"] == 8 and sent["temperature"] == 0


def test_a_continuation_sends_the_stored_conversation_and_not_the_old_instructions(tokenizer):
    gw = Gateway(tokenizer)
    gw.engine.script = [("text", "Paris."), ("text", "About 2 million.")]

    async def main():
        client = gw.client()
        one = await client.responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.")
        two = await client.responses.create(model=MODEL, input="Its population?", previous_response_id=one.id)
        return one, two

    one, two = run(main())
    assert two.previous_response_id == one.id and two.output_text == "About 2 million."
    assert gw.engine.bodies[1]["messages"] == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Its population?"},
    ]


def test_a_streamed_response_is_openais_event_sequence_and_is_retrievable_once_completed(tokenizer):
    gw = Gateway(tokenizer)
    gw.engine.script = [("text", "one two three")]
    events_of = TypeAdapter(ResponseStreamEvent)

    async def main():
        client = gw.client()
        events = []
        async with client.responses.stream(model=MODEL, input="count") as stream:
            async for event in stream:
                events.append(event)
        final = events[-1].response
        return events, await client.responses.retrieve(final.id)

    events, stored = run(main())
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[4:7] == ["response.output_text.delta"] * 3
    assert kinds[7:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:  # every event is one of the SDK's own types, field for field
        assert isinstance(events_of.validate_python(event.model_dump(warnings=False)), BaseModel)
    assert events[-1].response.output_text == "one two three " and events[-1].response.usage.output_tokens == 3
    assert stored.status == "completed" and stored.output_text == "one two three "


def test_a_tool_call_streams_as_a_function_call_item_and_its_output_continues_the_conversation(tokenizer):
    gw = Gateway(tokenizer)
    gw.engine.script = [("tool", "get_weather", '{"city":"Oslo"}'), ("text", "It is cold.")]

    async def main():
        client = gw.client()
        events = []
        async with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[TOOL]) as stream:
            async for event in stream:
                events.append(event)
        call = events[-1].response.output[0]
        answer = await client.responses.create(
            model=MODEL, previous_response_id=events[-1].response.id, tools=[TOOL],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}],
        )  # fmt: skip
        return events, call, answer

    events, call, answer = run(main())
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]  # fmt: skip
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city":"Oslo"}'
    assert call.call_id == "call_1" and answer.output_text == "It is cold."
    second = gw.engine.bodies[1]["messages"]
    assert second[1]["tool_calls"][0]["id"] == "call_1" and second[1]["role"] == "assistant"
    assert second[2] == {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}
    assert gw.engine.bodies[0]["tools"][0]["function"]["name"] == "get_weather"


def test_max_output_tokens_reached_is_incomplete_and_an_engine_failure_is_failed_and_stored_so(tokenizer):
    gw = Gateway(tokenizer)
    gw.engine.script = [("cut", "partial"), ("broken", "half way")]

    async def main():
        client = gw.client()
        cut = await client.responses.create(model=MODEL, input="long", max_output_tokens=1)
        events = []
        async with client.responses.stream(model=MODEL, input="x") as stream:
            async for event in stream:
                events.append(event)
        failed = events[-1].response
        stored = await client.responses.retrieve(failed.id)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="go on", previous_response_id=failed.id)
        return cut, events, stored, refused.value

    cut, events, stored, refused = run(main())
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "engine_error"
    assert stored.status == "failed" and stored.output_text == "half way "
    assert refused.body["param"] == "previous_response_id"


def test_another_tenants_response_is_a_404_to_get_continue_delete_and_list(tokenizer):
    gw = Gateway(tokenizer)

    async def main():
        mine = await gw.client().responses.create(model=MODEL, input="secret")
        theirs = gw.client("sk-other")
        failures = []
        for attempt in (theirs.responses.retrieve(mine.id), theirs.responses.delete(mine.id),
                        theirs.responses.input_items.list(mine.id),
                        theirs.responses.create(model=MODEL, input="more", previous_response_id=mine.id)):  # fmt: skip
            with pytest.raises(openai.NotFoundError) as exc:
                await attempt
            failures.append(exc.value.body)
        still = await gw.client().responses.retrieve(mine.id)
        await gw.client().responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            await gw.client().responses.retrieve(mine.id)
        return failures, still

    failures, still = run(main())
    assert still.output_text == "Hello there"
    assert failures[-1]["param"] == "previous_response_id" and failures[0]["param"] == "response_id"
    assert all(f["code"] == "response_not_found" for f in failures)
    assert len(gw.engine.bodies) == 1  # the refused continuation never reached an engine


def test_store_false_is_answered_and_not_kept(tokenizer):
    gw = Gateway(tokenizer)

    async def main():
        client = gw.client()
        unstored = await client.responses.create(model=MODEL, input="hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        return unstored

    assert run(main()).store is False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_memory_store_evicts_by_ttl_and_by_each_tenants_budget_and_says_why(tokenizer):
    clock = Clock()
    store = MemoryResponseStore(ttl_s=100, budget_bytes=6000, clock=clock)
    gw = Gateway(tokenizer, store)

    async def main():
        client = gw.client()
        ids = [(await client.responses.create(model=MODEL, input=f"turn {i}")).id for i in range(6)]
        other = (await gw.client("sk-other").responses.create(model=MODEL, input="mine")).id
        outcome = {}
        for rid in ids:
            try:
                await client.responses.retrieve(rid)
                outcome[rid] = "kept"
            except openai.NotFoundError as exc:
                outcome[rid] = exc.body["code"]
        with pytest.raises(openai.NotFoundError) as evicted:
            await client.responses.create(model=MODEL, input="go on", previous_response_id=ids[0])
        kept_other = (await gw.client("sk-other").responses.retrieve(other)).id
        clock.now = 101
        with pytest.raises(openai.NotFoundError) as expired:
            await client.responses.retrieve(ids[-1])
        return ids, outcome, evicted.value.body, kept_other == other, expired.value.body

    ids, outcome, evicted, other_kept, expired = run(main())
    kept = [rid for rid in ids if outcome[rid] == "kept"]
    assert kept == ids[-len(kept):] and 0 < len(kept) < len(ids), outcome  # the least recently written went
    assert {outcome[rid] for rid in ids if rid not in kept} == {"response_evicted"}
    assert evicted["param"] == "previous_response_id" and "byte budget" in evicted["message"]
    assert other_kept  # one tenant's writes never evict another's
    assert expired["code"] == "response_not_found"
    text = gw.state.metrics.render([MODEL]).decode()
    assert f'kvharbor_gateway_responses_evicted_total{{reason="budget"}} {len(ids) - len(kept)}.0' in text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input.0.call_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 9}, "temperature"),
        ({"input": ""}, "input"),
        ({"input": "hi", "previous_response_id": "bad id!"}, "previous_response_id"),
    ],
)
def test_bad_input_is_a_400_naming_its_field(tokenizer, body, param):
    gw = Gateway(tokenizer)

    async def main():
        async with gw.raw() as http:
            return await http.post("/v1/responses", json={"model": MODEL, **body})

    reply = run(main())
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert gw.engine.bodies == []


def test_an_unknown_previous_response_id_is_a_404_naming_it_and_cancel_says_why_it_cannot(tokenizer):
    gw = Gateway(tokenizer)

    async def main():
        async with gw.raw() as http:
            unknown = await http.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                             "previous_response_id": "resp_nothere"})  # fmt: skip
            rid = (await http.post("/v1/responses", json={"model": MODEL, "input": "x"})).json()["id"]
            cancel = await http.post(f"/v1/responses/{rid}/cancel")
            return unknown, cancel

    unknown, cancel = run(main())
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    assert cancel.status_code == 400 and cancel.json()["error"]["code"] == "not_background"


def test_reasoning_becomes_a_reasoning_item_before_the_message_whole_and_streamed(tokenizer):
    gw = Gateway(tokenizer)
    gw.engine.script = [("think", "let me see", "Paris."), ("think", "let me see", "Paris.")]

    async def main():
        client = gw.client()
        whole = await client.responses.create(model=MODEL, input="Capital?", reasoning={"effort": "low"})
        events = []
        async with client.responses.stream(model=MODEL, input="Capital?") as stream:
            async for event in stream:
                events.append(event)
        async with gw.raw() as http:
            note = await http.post("/v1/responses", json={"model": MODEL, "input": "x", "reasoning": {}})
        return whole, events, note

    whole, events, note = run(main())
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "let me see" and whole.output_text == "Paris."
    kinds = [e.type for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done"]  # fmt: skip
    assert kinds[6] == "response.output_item.done" and kinds[7] == "response.output_item.added"
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "Paris. "
    # SmolLM2 (the tokenizer here) writes no reasoning apart: `reasoning` is accepted, and named as ignored
    assert note.status_code == 200 and note.headers["x-kvharbor-ignored-fields"] == "reasoning"


class EmptyIndex:
    """A KV index that has heard of no block yet (the last turn's KV events are still in flight)."""

    async def lookup(self, model, hashes, ids):
        return {}

    async def close(self) -> None:
        pass


def test_a_continuation_goes_where_its_last_turn_ran_before_the_index_knows(tokenizer):
    gw = Gateway(tokenizer, engines=("http://a", "http://b"), index=EmptyIndex())
    document = "Read this carefully. " + "The harbor crane lifts cargo onto the ship. " * 12

    async def main():
        client = gw.client()
        one = await client.responses.create(model=MODEL, input=document, instructions="Be brief.")
        first = gw.engine.hosts[-1]
        # The engine that ran turn 1 now has the longer queue: by load alone the other would win.
        for engine in gw.pool.all(MODEL):
            engine.load = dataclasses.replace(engine.load, waiting=3 if engine.url.endswith(first) else 0)
        await client.responses.create(model=MODEL, input="And then?", instructions="Be brief.",
                                      previous_response_id=one.id)  # fmt: skip
        followed = gw.engine.hosts[-1]
        # Other instructions: the new prompt does not start with turn 1's, so nothing is cached there.
        await client.responses.create(model=MODEL, input="And then?", instructions="Be verbose.",
                                      previous_response_id=one.id)  # fmt: skip
        return first, followed, gw.engine.hosts[-1]

    first, followed, changed = run(main())
    assert followed == first
    assert changed != first


class DownStore:
    """A store whose Redis is away: every call fails."""

    async def put(self, tenant, rid, record):
        raise ConnectionError("redis is away")

    async def get(self, tenant, rid):
        raise ConnectionError("redis is away")

    async def delete(self, tenant, rid):
        raise ConnectionError("redis is away")


def test_when_the_store_is_away_no_answer_is_handed_out_as_continuable(tokenizer):
    gw = Gateway(tokenizer, DownStore())

    async def main():
        client = gw.client()
        with pytest.raises(openai.InternalServerError) as unary:
            await client.responses.create(model=MODEL, input="hi")
        events = []
        async with client.responses.stream(model=MODEL, input="hi") as stream:
            async for event in stream:
                events.append(event)
        with pytest.raises(openai.InternalServerError) as read:
            await client.responses.retrieve("resp_any")
        unstored = await client.responses.create(model=MODEL, input="hi", store=False)
        return unary.value, events, read.value, unstored

    unary, events, read, unstored = run(main())
    assert unary.status_code == 503 and unary.body["code"] == "store_unavailable"
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "store_unavailable"
    assert read.status_code == 503 and unstored.output_text == "Hello there"  # store: false needs no store
    text = gw.state.metrics.render([MODEL]).decode()
    assert "kvharbor_gateway_responses_store_failures_total 3.0" in text


def test_a_stored_conversation_that_no_longer_fits_names_previous_response_id(tokenizer):
    gw = Gateway(tokenizer)  # the gateway here accepts prompts of up to 1,000 tokens
    long_turn = "harbor crane cargo " * 100  # ~300 tokens a turn

    async def main():
        client = gw.client()
        rid = (await client.responses.create(model=MODEL, input=long_turn)).id
        for _ in range(4):
            try:
                rid = (await client.responses.create(model=MODEL, input=long_turn, previous_response_id=rid)).id
            except openai.BadRequestError as exc:
                return exc.body
        return None

    refused = run(main())
    assert refused is not None and refused["param"] == "previous_response_id" and refused["code"] == "prompt_too_long"
    assert "no longer fits" in refused["message"]
