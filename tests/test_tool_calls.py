"""Tool calling without a model (common/tool_calls.py, engine/serve/tool_responses.py): what the
tools do to the prompt and to the output constraint, how outputs become OpenAI tool calls, and how
a stream's deltas carry them."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvharbor.common.openai_api import ChatCompletionRequest
from kvharbor.common.tool_calls import MAX_PARALLEL_CALLS, ToolUse, messages_for_template, parse_output
from kvharbor.common.tool_parsers import parse_hermes
from kvharbor.engine.serve.tool_responses import ToolCallStream, tool_message

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

AUTO = ToolUse("auto", None, frozenset({"a", "b", "get_weather"}))
REQUIRED = ToolUse("required", None, frozenset({"a", "b"}))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})


def test_the_tool_choice_decides_the_mode_the_prompt_and_the_constraint():
    assert chat().tool_mode() == "none" and chat().sampling_kwargs()["structured"] is None
    auto = chat(tools=[WEATHER, TIME])
    assert auto.tool_mode() == "auto" and auto.sampling_kwargs()["structured"] is None
    assert [t["function"]["name"] for t in auto.prompt_tools()] == ["get_weather", "get_time"]
    assert chat(tools=[WEATHER], tool_choice="none").prompt_tools() is None  # out of the prompt too
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = named.sampling_kwargs()["structured"]
    assert named.tool_mode() == "named" and spec["kind"] == "json"
    assert spec["value"]["properties"] == {"city": {"type": "string"}}
    assert spec["value"]["additionalProperties"] is False  # strict: no invented keys
    required = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    array = required.sampling_kwargs()["structured"]["value"]
    assert array["type"] == "array" and array["minItems"] == 1 and array["maxItems"] == 1
    parallel = chat(tools=[WEATHER], tool_choice="required").sampling_kwargs()["structured"]["value"]
    assert parallel["maxItems"] == MAX_PARALLEL_CALLS  # a repeating model stops there, not at its context
    assert [c["properties"]["name"]["const"] for c in array["items"]["anyOf"]] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "distinct"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "pattern"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "drop"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_problem(fields, says):
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert says in str(err.value)


def test_a_template_without_tools_gets_them_and_the_turns_in_hermes_form():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]  # fmt: skip
    out = messages_for_template(turns, [WEATHER], template_takes_tools=False)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    block = out[2]["content"]
    assert block.startswith("<tool_call>") and json.loads(block.split("\n")[1]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}  # fmt: skip
    assert out[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert messages_for_template(turns, [WEATHER], template_takes_tools=True) is turns


def test_hermes_calls_are_parsed_out_of_text_and_anything_else_stays_text():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me look." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
    assert [c["function"]["name"] for c in parse_hermes(two)[1]] == ["a", "b"]  # an unclosed last tag too
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    required = parse_output('[{"name": "a", "parameters": {"x": 1}}]', REQUIRED)
    assert required[1][0]["function"]["arguments"] == '{"x": 1}'
    named = ToolUse("named", "a", frozenset({"a"}))
    assert parse_output('{"x": 1}', named)[1][0]["function"] == {"name": "a", "arguments": '{"x": 1}'}


def test_a_finished_message_says_tool_calls_and_a_cut_one_stays_text():
    message, reason = tool_message('[{"name": "a", "parameters": {}}]', "stop", REQUIRED)
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "a"
    message, reason = tool_message('[{"name": "a", "par', "length", REQUIRED)
    assert reason == "length" and message == {"role": "assistant", "content": '[{"name": "a", "par'}
    message, reason = tool_message("Just words.", "stop", AUTO)
    assert reason == "stop" and message == {"role": "assistant", "content": "Just words."}


@pytest.mark.parametrize("streamed", [False, True])
def test_calls_cut_short_keep_those_they_completed(streamed):
    """Issue 47, item 11: a `required` array (or `auto` blocks) cut by max_tokens returned its
    complete calls as plain content; an agent loop took the raw JSON for its answer."""
    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}} , {"name": "a", "para'
    hermes = ('Checking.\n<tool_call>\n{"name": "a", "arguments": {"x": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "b", "argu')  # fmt: skip
    for text, use, names in [(cut, REQUIRED, ["a", "b"]), (hermes, AUTO, ["a"])]:
        if streamed:
            stream = ToolCallStream(use)
            stream.delta(text[:20], None)
            message, reason = stream.delta(text[20:], "length")
            message = {"tool_calls": message["tool_calls"], "content": message.get("content")}
        else:
            message, reason = tool_message(text, "length", use)
        assert reason == "length"
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["x"] in (1, 2)


def test_auto_calls_are_only_of_offered_functions_and_one_unless_parallel():
    """Issue 47, item 7: a call naming a function not in `tools` is not one an agent can run: the
    output stays text. parallel_tool_calls false keeps the first call."""
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>')  # fmt: skip
    assert [c["function"]["name"] for c in parse_output(two, AUTO)[1]] == ["a", "b"]
    one = ToolUse("auto", None, frozenset({"a", "b"}), parallel=False)
    assert [c["function"]["name"] for c in parse_output(two, one)[1]] == ["a"]
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_output(unknown, AUTO) == (unknown, [])
    not_an_object = '<tool_call>{"name": "a", "arguments": "[1, 2]"}</tool_call>'
    assert parse_output(not_an_object, AUTO) == (not_an_object, [])


def _run(stream: ToolCallStream, pieces: list[str]) -> tuple[list[dict], str | None]:
    deltas, reason = [], None
    for i, piece in enumerate(pieces):
        delta, reason = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        if delta:
            deltas.append(delta)
    return deltas, reason


def test_a_named_call_streams_its_name_first_then_argument_fragments():
    deltas, reason = _run(ToolCallStream(ToolUse("named", "get_weather")), ['{"ci', 'ty": "Pa', 'ris"}', ""])
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_") and first["index"] == 0
    assert "name" not in deltas[1]["tool_calls"][0]["function"]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert reason == "tool_calls"


def test_auto_streams_text_at_once_holds_back_a_possible_tag_and_sends_calls_at_the_end():
    stream = ToolCallStream(AUTO)
    assert stream.delta("Sure. <tool", None) == ({"content": "Sure. "}, None)  # "<tool" may open a tag
    assert stream.delta('_call>{"name": "a", ', None) == (None, None)
    delta, reason = stream.delta('"arguments": {"k": 1}}</tool_call>', "stop")
    assert reason == "tool_calls" and "content" not in delta
    assert delta["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"k": 1}'}
    plain = ToolCallStream(AUTO)
    assert _run(plain, ["a <t", "ea"]) == ([{"content": "a "}, {"content": "<tea"}], "stop")
    assert _run(ToolCallStream(AUTO), ["a <b", "> c"]) == ([{"content": "a <b"}, {"content": "> c"}], "stop")
