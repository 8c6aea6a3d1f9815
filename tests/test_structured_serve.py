"""Structured outputs and tool calls through the real servers, with the real `openai` client:
`kvharbor serve` alone and behind `kvharbor gateway` (which tokenizes the chat, tools included,
and passes the rest on). Every bad constraint is a 400 naming the problem at both."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from servers import EngineServerProcess, GatewayProcess, metric, start_together, write_tenants

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "1024",
               "--structured-max-bytes", "4096", "--structured-max-depth", "12")  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured")
    engine = EngineServerProcess(logs, *ENGINE_ARGS)
    try:
        start_together([engine])
        tenants = logs / "tenants.yaml"
        write_tenants(tenants, [{"name": "acme", "key": "sk-acme"}])
        with GatewayProcess(logs, "--engines", engine.url, "--tenants-file", str(tenants)) as gateway:
            gateway.wait_ready()
            yield {"engine": engine, "gateway": gateway}
    finally:
        engine.stop()


@pytest.fixture(params=["engine", "gateway"])
def client(request, servers):
    server = servers[request.param]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_gives_a_parsed_object(client):
    resp = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                                         response_format=Person, temperature=0, max_tokens=60)  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)


def test_structured_outputs_extra_json_choice_and_regex(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for extra, check in (
        ({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no") or pytest.fail(t)),
        ({"regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t) or pytest.fail(t)),
    ):
        resp = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=40,
                                              extra_body={"structured_outputs": extra})  # fmt: skip
        assert resp.choices[0].finish_reason == "stop"
        check(resp.choices[0].message.content)


def test_a_forced_call_streamed_assembles_from_its_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    name, arguments, ids, finish = "", "", set(), None
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += call.function.name or ""
            arguments += call.function.arguments or ""
            ids |= {call.id} - {None}
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert name == "get_weather" and len(ids) == 1 and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), {**WEATHER["function"]["parameters"], "additionalProperties": False})


def test_required_gives_calls_that_satisfy_their_tools_schemas(client):
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          temperature=0, max_tokens=80)  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_an_auto_call_in_hermes_form_is_parsed_into_tool_calls(client):
    """SmolLM2-135M was not trained to call tools, so a grammar makes it write the Hermes block a
    tool-trained model would: the auto parser must turn that text into a call."""
    opening = json.dumps('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    closing = json.dumps('", "unit": "c"}}\n</tool_call>')
    hermes = f"start: {opening} /[A-Z][a-z]{{2,8}}/ {closing}"
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                          temperature=0, max_tokens=60,
                                          extra_body={"structured_outputs": {"grammar": hermes}})  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "c"


def test_a_tool_result_goes_back_through_the_template(client, servers):
    turns = [*ASK,
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]  # fmt: skip
    resp = client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], temperature=0, max_tokens=8)
    bare = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=8)
    # The call and its result are in the prompt: the Hermes blocks add their tokens.
    assert resp.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    prompt = httpx.post(servers["engine"].url + "/tokenize", json={"model": MODEL, "messages": turns}).json()
    assert prompt["count"] > 0


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "not"),
    ({"structured_outputs": {"regex": "[a-"}}, "unclosed"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(900))}},
     "structured_max_bytes"),
    ({"structured_outputs": {"json": json.loads('{"items":' * 16 + "{}" + "}" * 16)}}, "structured_max_depth"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "says"), BAD, ids=[b[1] for b in BAD])
def test_each_bad_constraint_is_a_400_naming_the_problem(servers, extra, says):
    for name in ("engine", "gateway"):
        resp = httpx.post(servers[name].url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-acme"},
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}, timeout=60)  # fmt: skip
        assert resp.status_code == 400, (name, resp.text)
        assert says in resp.json()["error"]["message"], (name, resp.text)


def test_the_engine_counts_constrained_requests_and_compiles(servers):
    text = httpx.get(servers["engine"].url + "/metrics").text
    assert metric(text, "kvharbor_structured_requests_total", 'kind="json"') >= 1
    assert metric(text, "kvharbor_structured_requests_total", 'kind="choice"') >= 1
    assert "kvharbor_structured_compiles_total" in text and "kvharbor_structured_mask_share" in text
