"""The Responses API end to end: a real engine (SmolLM2, CPU), a real redis-server and two real
gateway processes sharing it, driven by clients that speak Responses by default: the `openai`
SDK (create, stream, parse), an openai-agents Agent with a function tool, and pydantic-ai."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel
from servers import EngineServerProcess, GatewayProcess, RedisProcess, metric, start_together, wait_for, write_tenants

pytestmark = pytest.mark.slow  # a real engine, redis-server and gateways

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-num-batched-tokens", "512")
TENANTS = [{"name": "acme", "key": "sk-acme"}, {"name": "rival", "key": "sk-rival"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("responses")
    tenants = logs / "tenants.yaml"
    write_tenants(tenants, TENANTS)
    with RedisProcess(logs / "redis") as rds:
        engine = EngineServerProcess(logs, "--redis-url", rds.url, *ENGINE_ARGS)
        args = ("--engines", engine.url, "--tenants-file", str(tenants), "--redis-url", rds.url)
        gateways = [GatewayProcess(logs, *args), GatewayProcess(logs, *args)]
        procs = [engine, *gateways]
        try:
            start_together(procs)
            for g in gateways:
                wait_for(lambda g=g: httpx.get(g.url + "/ready").status_code == 200, what="gateway sees its engine")
            yield gateways
        finally:
            for p in reversed(procs):
                p.stop()


def client(gateway, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_turn_two_on_another_replica_continues_turn_one_streamed_and_not(stack):
    one, two = stack
    first = client(one).responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                         max_output_tokens=12)  # fmt: skip
    assert first.status in ("completed", "incomplete") and first.output_text
    kinds, final = [], None
    with client(two).responses.stream(model=MODEL, input="And of Spain?", previous_response_id=first.id,
                                      temperature=0, max_output_tokens=12) as stream:  # fmt: skip
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert final.previous_response_id == first.id and final.output_text
    # Turn 2's prompt is turn 1's conversation and more: its input counts turn 1's tokens, and the
    # engine (where turn 1 ran) had turn 1's blocks cached.
    assert final.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0
    stored = client(one).responses.retrieve(final.id)  # written by replica two, read by replica one
    assert stored.output_text == final.output_text and stored.status == final.status


def test_another_tenant_cannot_read_continue_or_delete_a_response(stack):
    one, two = stack
    mine = client(one).responses.create(model=MODEL, input="Say hi.", max_output_tokens=4)
    rival = client(two, "sk-rival")
    for attempt in (lambda: rival.responses.retrieve(mine.id), lambda: rival.responses.delete(mine.id),
                    lambda: rival.responses.create(model=MODEL, input="x", previous_response_id=mine.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert client(two).responses.retrieve(mine.id).id == mine.id
    text = httpx.get(two.admin_url + "/metrics", timeout=10).text
    assert metric(text, "kvharbor_gateway_responses_missed_total", 'reason="unknown"') >= 3


class City(BaseModel):
    name: str
    country: str


def test_parse_returns_the_pydantic_model(stack):
    parsed = client(stack[0]).responses.parse(
        model=MODEL, input="Give a city and its country as JSON.", text_format=City, temperature=0, max_output_tokens=48
    )
    assert isinstance(parsed.output_parsed, City)


def test_an_openai_agents_agent_calls_its_function_tool_on_its_default_responses_model(stack):
    from agents import (
        Agent,
        AsyncOpenAI,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=stack[0].url + "/v1", api_key="sk-acme", max_retries=0),
                              use_for_tracing=False)  # fmt: skip
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"It is sunny in {city}."

    # A forced call (the 135M model would not choose one), then auto: the SDK resets tool_choice
    # after a call, and the model answers from the tool's output.
    agent = Agent(name="weather", model=MODEL, instructions="Answer with the tool's result.", tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=32, temperature=0))  # fmt: skip
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(called) == 1 and called[0]
    assert isinstance(result.final_output, str)
    types = [item.type for item in result.new_items]
    assert types[:2] == ["tool_call_item", "tool_call_output_item"]


def test_pydantic_ai_with_the_openai_responses_model(stack):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=stack[1].url + "/v1", api_key="sk-acme"))
    agent = Agent(model, instructions="Be brief.")
    result = agent.run_sync("Name a color.", model_settings={"max_tokens": 8, "temperature": 0})
    assert isinstance(result.output, str) and result.output
    assert result.usage.input_tokens > 0


def test_a_stream_the_client_leaves_is_stored_as_failed(stack):
    one, two = stack
    body = {"model": MODEL, "input": "Write a long story about the sea.", "stream": True, "max_output_tokens": 200,
            "temperature": 0}  # fmt: skip
    rid = None
    with httpx.stream("POST", one.url + "/v1/responses", json=body, headers={"Authorization": "Bearer sk-acme"},
                      timeout=60) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                rid = rid or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break  # the client leaves mid-answer
    wait_for(lambda: _status(two, rid) == "failed", 30, "the abandoned response to be stored as failed")
    stored = client(two).responses.retrieve(rid)
    assert stored.error.code == "client_closed" and stored.output  # what was streamed before it left
    with pytest.raises(openai.BadRequestError):
        client(one).responses.create(model=MODEL, input="go on", previous_response_id=rid)


def _status(gateway, rid: str) -> str | None:
    try:
        return client(gateway).responses.retrieve(rid).status
    except openai.NotFoundError:
        return None
