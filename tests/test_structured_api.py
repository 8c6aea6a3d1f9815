"""The wire shapes of structured outputs (common/structured_outputs.py): OpenAI's response_format,
vLLM's structured_outputs and guided_* extras, each to one engine spec; and the requests that must
be refused before any engine sees them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvharbor.common.openai_api import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def spec(**fields):
    return ChatCompletionRequest.model_validate({**CHAT, **fields}).sampling_kwargs()["structured"]


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"kind": "json", "value": {"type": "object"}}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         {"kind": "json", "value": SCHEMA}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         {"kind": "json", "value": {**SCHEMA, "additionalProperties": False}}),  # strict: no keys beyond the listed
        ({"structured_outputs": {"json": SCHEMA}}, {"kind": "json", "value": SCHEMA}),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, {"kind": "json", "value": {"type": "string"}}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"kind": "regex", "value": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["a", "b"]}}, {"kind": "choice", "value": ["a", "b"]}),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, {"kind": "grammar", "value": 'start: "x"'}),
        ({"guided_json": SCHEMA}, {"kind": "json", "value": SCHEMA}),
        ({"guided_choice": ["y", "n"]}, {"kind": "choice", "value": ["y", "n"]}),
        ({"guided_regex": "x+"}, {"kind": "regex", "value": "x+"}),
        ({"guided_grammar": 'root ::= "x"'}, {"kind": "grammar", "value": 'root ::= "x"'}),
    ],
)  # fmt: skip
def test_each_way_of_asking_becomes_one_engine_spec(fields, want):
    assert spec(**fields) == want


def test_completions_take_the_same_fields():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a"]}})
    assert body.sampling_kwargs()["structured"] == {"kind": "choice", "value": ["a"]}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "JSON Schema object"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"whatever": 1}}, "whatever"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "one output constraint"),
    ],
)  # fmt: skip
def test_malformed_constraints_are_refused_at_parse_time(fields, says):
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({**CHAT, **fields})
    assert says in str(err.value)
