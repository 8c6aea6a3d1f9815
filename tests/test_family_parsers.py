"""Tool-call and reasoning parsers per model family (common/tool_parsers.py, common/reasoning.py),
the one table that picks them (common/model_families.py), and what an engine's chat answer makes
of them, whole and streamed (engine/serve/openai_responses.py)."""

from __future__ import annotations

import json

import pytest

from kvharbor.common.model_families import reasoning_parser, tool_call_parser, vllm_tool_args
from kvharbor.common.reasoning import ReasoningStream, split_reasoning
from kvharbor.common.tool_calls import ToolUse
from kvharbor.common.tool_parsers import parser
from kvharbor.engine.outputs import CompletionOutput
from kvharbor.engine.serve.openai_responses import ResponseBuilder
from kvharbor.engine.serve.tool_responses import ToolCallStream


def calls_of(parsed):
    content, calls = parsed
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.",
         [("f", {"a": 1})]),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
         None, [("f", {"a": 1}), ("g", {})]),
        ("mistral", 'Let me check.[TOOL_CALLS] [{"name": "f", "arguments": {"a": "x"}}]', "Let me check.",
         [("f", {"a": "x"})]),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 2}[TOOL_CALLS]g[ARGS]{}', None, [("f", {"a": 2}), ("g", {})]),
        ("pythonic", '[f(a=1, b="two"), g()]', None, [("f", {"a": 1, "b": "two"}), ("g", {})]),
        ("pythonic", 'I will look.\n```tool_code\nf(city="Oslo")\n```', "I will look.", [("f", {"city": "Oslo"})]),
    ],
)
def test_each_family_format_parses_to_openai_tool_calls(name, text, content, calls):
    assert calls_of(parser(name).parse(text, False)) == (content, calls)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("llama3_json", "The answer is {not json}"),
        ("llama3_json", '{"no_name": 1}'),
        ("mistral", "[TOOL_CALLS] not an array"),
        ("pythonic", "[f(1)]"),  # positional arguments: not a call an agent can run
        ("pythonic", "[__import__('os').system('x')]"),  # not a plain call: text, never evaluated
        ("pythonic", "Just words."),
    ],
)
def test_what_does_not_parse_as_calls_stays_text(name, text):
    assert parser(name).parse(text, False) == (text, [])


def test_an_output_cut_short_keeps_the_calls_it_completed():
    cut = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "param'
    assert calls_of(parser("llama3_json").parse(cut, True)) == (None, [("f", {"a": 1})])
    assert parser("llama3_json").parse(cut, False) == (cut, [])


def test_the_family_table_is_what_the_engine_and_the_vllm_launchers_read():
    assert tool_call_parser("llama", template_takes_tools=True) == "llama3_json"
    assert tool_call_parser("llama", template_takes_tools=False) == "hermes"  # kvharbor prompted in Hermes' form
    assert tool_call_parser("mistral", True) == "mistral" and tool_call_parser("gemma3", True) == "pythonic"
    assert reasoning_parser("qwen3") == "qwen3" and reasoning_parser("llama") is None
    args = vllm_tool_args("hermes", "qwen3")
    assert args[args.index("--tool-call-parser") + 1] == "hermes"
    assert args[args.index("--reasoning-parser") + 1] == "qwen3"
    assert "--reasoning-parser" not in vllm_tool_args("hermes")


def stream(chunks: list[str], make) -> list:
    s = make()
    return [s.delta(c, "stop" if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)]


@pytest.mark.parametrize(
    ("name", "chunks", "calls"),
    [
        ("llama3_json", ['{"na', 'me": "f", "parameters": {}}'], ["f"]),
        ("mistral", ["Checking", " now.[TOOL", '_CALLS] [{"name": "f", "arguments": {}}]'], ["f"]),
        ("pythonic", ["[f(", "a=1)]"], ["f"]),
    ],
)
def test_a_stream_sends_text_before_the_call_and_never_a_part_of_the_call_as_text(name, chunks, calls):
    use = ToolUse("auto", None, frozenset({"f"}), True, name)
    deltas = stream(chunks, lambda: ToolCallStream(use))
    content = "".join((d or {}).get("content") or "" for d, _ in deltas)
    final, reason = deltas[-1]
    assert [c["function"]["name"] for c in final["tool_calls"]] == calls and reason == "tool_calls"
    assert "[TOOL" not in content and "{" not in content and "(" not in content
    assert content.strip() in ("", "Checking now.")


def test_a_llama3_answer_in_words_streams_as_words_once_it_cannot_be_a_call():
    use = ToolUse("auto", None, frozenset({"f"}), True, "llama3_json")
    deltas = stream(["Paris", " is", " big."], lambda: ToolCallStream(use))
    assert "".join(d["content"] for d, _ in deltas if d) == "Paris is big." and deltas[0][0] == {"content": "Paris"}


@pytest.mark.parametrize(
    ("parser_name", "text", "reasoning", "answer"),
    [
        ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
        ("qwen3", "Paris.", None, "Paris."),  # thinking off: all answer
        ("qwen3", "<think>still thinking", "still thinking", ""),  # cut short inside the reasoning
        ("deepseek_r1", "hmm</think>Paris.", "hmm", "Paris."),
    ],
)
def test_reasoning_is_split_from_the_answer_whole_and_streamed_alike(parser_name, text, reasoning, answer):
    assert split_reasoning(text, parser_name) == (reasoning, answer)
    s = ReasoningStream(parser_name)
    pieces = [s.delta(ch) for ch in text] + [s.delta("", finished=True)]
    assert "".join(r for r, _ in pieces) == (reasoning or "") and "".join(a for _, a in pieces) == answer
    assert all("<" not in r for r, _ in pieces)  # no tag, nor part of one, ever reaches the client


def test_an_unknown_reasoning_parser_says_which_there_are():
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningStream("nope")


def test_a_chat_answer_carries_its_reasoning_and_its_tool_call_whole_and_streamed():
    text = '<think>need weather</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    use = ToolUse("auto", None, frozenset({"f"}), True, "hermes")
    builder = ResponseBuilder("chat", "chatcmpl-1", "m", None, 1, tools=use, reasoning="qwen3")
    whole = builder._choice(0, CompletionOutput(0, text=text, finish_reason="stop"), False, "")
    assert whole["message"]["reasoning"] == "need weather" and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "f" and whole["message"]["content"] is None
    streamed = ResponseBuilder("chat", "chatcmpl-2", "m", None, 1, tools=use, reasoning="qwen3")
    chunks = []
    for i in range(0, len(text), 5):
        piece, last = text[i : i + 5], i + 5 >= len(text)
        sample = CompletionOutput(0, delta_text=piece, finish_reason="stop" if last else None)
        chunk = streamed.delta_chunk(0, sample, False, 0)
        if chunk is not None:
            chunks.append(chunk["choices"][0])
    assert "".join(c["delta"].get("reasoning", "") for c in chunks) == "need weather"
    assert not any(c["delta"].get("content") for c in chunks)
    assert chunks[-1]["delta"]["tool_calls"][0]["function"]["name"] == "f"
