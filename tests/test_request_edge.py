"""Issue 47: every request field with a size or range is checked once, at the edge, before any
recursive or native code sees it (common/request_body.py, against common/request_limits.py), and
each bad input is a 400 naming its field. The same reader runs at the gateway and the engine
server; here it is driven directly, and through the in-process gateway (fake engines)."""

from __future__ import annotations

import json

import pytest
from test_gateway_lora import BASE, complete, run_app

from kvharbor.common.openai_api import APIError, ChatCompletionRequest, CompletionRequest
from kvharbor.common.request_body import IGNORED_HEADER, parse_body
from kvharbor.common.request_limits import RequestLimits, json_depth

LIMITS = RequestLimits()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


def refused(body: dict | bytes, model=ChatCompletionRequest, limits: RequestLimits = LIMITS) -> APIError:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as err:
        parse_body(data, model, limits)
    assert err.value.status == 400
    return err.value


def nested(levels: int, leaf: str = "1") -> str:
    """A JSON text `levels` objects deep, built without recursion."""
    return '{"a":' * levels + leaf + "}" * levels


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**64 - 1}, "seed"),  # item 1: it crossed the core link and overflowed seed + i
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 17}, "n"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**40}, "min_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"99999999999999999999": 1}}, "logit_bias"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 257}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids.0"),
        ({"prompt_token_ids": [1, 2**33]}, "prompt_token_ids.1"),
        ({"priority": 2**70}, "priority"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"d": "x" * 70000}}}},
         "response_format"),
        ({"guided_regex": "a" * 70000}, "guided_regex"),
    ],
)  # fmt: skip
def test_each_bound_is_a_400_naming_its_field(fields, param):
    err = refused({**CHAT, **fields})
    assert err.param is not None and err.param.startswith(param), (err.param, err.message)


def test_a_completions_prompt_list_is_capped():
    err = refused({"model": "m", "prompt": [[5]] * 65}, CompletionRequest)
    assert err.param == "prompt" and "max_prompts" in err.message
    assert parse_body(json.dumps({"model": "m", "prompt": [[5]] * 64}).encode(), CompletionRequest, LIMITS)
    err = refused({"model": "m", "prompt": "x", "n": 2, "best_of": 17}, CompletionRequest)
    assert err.param == "best_of"


@pytest.mark.parametrize("levels", [40, 100_000])
def test_a_deep_body_is_a_400_before_anything_recurses(levels):
    """Item 4: a deeply nested schema gave a 500 (RecursionError in to_wire or strict mode's
    closed_objects) before the depth check, which ran only in the engine core."""
    schema = nested(levels, '{"type": "string"}')
    for where, text in [
        ("response_format", '{"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": %s}}'),
        ("tools", '[{"type": "function", "function": {"name": "f", "parameters": %s}}]'),
        ("structured_outputs", '{"json": %s}'),
    ]:
        body = json.dumps(CHAT)[:-1] + f', "{where}": {text % schema}}}'
        err = refused(body.encode())
        assert err.param == where and ("structured_max_depth" in err.message or "nests deeper" in err.message)


def test_a_schema_just_within_the_depth_limit_passes_and_one_past_it_does_not():
    small = RequestLimits(structured_max_depth=4)
    ok = {"type": "object", "properties": {"a": {"type": "string"}}}  # 3 levels
    too_deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}  # 5
    assert json_depth(ok) == 3 and json_depth(too_deep) == 5
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": ok}}
    assert parse_body(json.dumps({**CHAT, "response_format": fmt}).encode(), ChatCompletionRequest, small)
    fmt["json_schema"]["schema"] = too_deep
    err = refused({**CHAT, "response_format": fmt}, limits=small)
    assert err.param == "response_format" and "structured_max_depth" in err.message


@pytest.mark.parametrize(
    "calls",
    [
        [{"function": {"arguments": "{}"}}],  # no name
        [{"type": "function", "function": "get_weather"}],
        ["get_weather"],
        [{"type": "function", "function": {"name": "bad name!", "arguments": "{}"}}],
        {"function": {"name": "f"}},
    ],
)
def test_malformed_assistant_tool_calls_are_a_400(calls):
    """Item 3: they gave a 500 (KeyError, TypeError or AttributeError in common/tool_calls.py)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]
    err = refused({**CHAT, "messages": messages})
    assert err.param.startswith("messages.1.tool_calls")


def test_well_formed_assistant_tool_calls_reach_the_template():
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    calls = [{"id": "call_1", "type": "function", "function": call}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    parsed = parse_body(json.dumps({**CHAT, "messages": messages}).encode(), ChatCompletionRequest, LIMITS)
    from kvharbor.common.openai_api import message_dicts
    from kvharbor.common.tool_calls import messages_for_template

    rendered = messages_for_template(message_dicts(parsed.body.messages), None, False)
    assert '"city": "Paris"' in rendered[1]["content"] and "sunny" in rendered[2]["content"]


def test_unknown_fields_are_named_and_dropped():
    parsed = parse_body(json.dumps({**CHAT, "temprature": 0.2, "chat_template": "{{ evil }}"}).encode(),
                        ChatCompletionRequest, LIMITS)  # fmt: skip
    assert parsed.ignored == ("chat_template", "temprature")
    assert parsed.headers() == {IGNORED_HEADER: "chat_template, temprature"}
    assert "temprature" not in parsed.raw and parsed.raw["model"] == "m"
    odd = parse_body(json.dumps({**CHAT, "t\u00e9\n": 1}).encode(), ChatCompletionRequest, LIMITS)
    assert odd.headers()[IGNORED_HEADER].isascii() and odd.headers()[IGNORED_HEADER].isprintable()


def test_limits_take_one_name_everywhere():
    from kvharbor.common.config import load_config
    from kvharbor.engine.config import EngineConfig
    from kvharbor.gateway.config import GatewayConfig

    env = {"KVHARBOR_MAX_PROMPTS": "8", "KVHARBOR_STRUCTURED_MAX_DEPTH": "12"}
    for cls in (EngineConfig, GatewayConfig):
        limits = load_config(cls, env=env).limits
        assert (limits.max_prompts, limits.structured_max_depth) == (8, 12)
    with pytest.raises(ValueError, match="max_stop_length"):
        RequestLimits(max_stop_length=5000)  # a migrated stream's held text must stay bounded
    with pytest.raises(ValueError, match="structured_max_depth"):
        RequestLimits(structured_max_depth=10_000)  # strict mode's recursion must stay bounded


# -- through the gateway (in-process, fake engines) ------------------------------------------------


def test_the_gateway_drops_unknown_fields_before_any_engine_and_says_so():
    async def session(client, fake, index):
        resp = await complete(client, "sk-acme", BASE, temprature=0.1, vllm_xargs={"x": 1})
        assert resp.status_code == 200, resp.text
        assert resp.headers[IGNORED_HEADER] == "temprature, vllm_xargs"
        ((_engine, body),) = fake.calls
        return body

    body = run_app(session)
    assert "temprature" not in body and "vllm_xargs" not in body


def test_the_gateway_refuses_a_prompt_list_over_the_cap():
    async def session(client, fake, index):
        resp = await client.post(
            "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
            json={"model": BASE, "prompt": [[5, 6]] * 65, "max_tokens": 2},
        )  # fmt: skip
        assert not fake.calls
        return resp

    resp = run_app(session)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
