"""Hostile requests for the hostile-neighbour property test (tests/test_hostile_neighbours.py).

Each request field gets its boundary and hostile values, labelled ("max", "max+1", "int32", ...);
Hypothesis combines several fields in one request (and now and then replaces the whole body: too
large, nested too deep, not JSON). `judge` says whether an answer kept the rule: a 4xx naming a
field the request sent, or a 200 that keeps its promise (the answers it asked for, JSON that
parses and validates where a schema was asked for, tool calls of offered functions), never a 5xx.
`Coverage` counts, per field, the values tried and what they got.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from hypothesis import strategies as st

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


def nested(levels: int) -> dict:
    """A JSON schema `levels` objects deep, built without recursion."""
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return node


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


# field -> [(label, value)]: the values each field is tried with, in both endpoints
SHARED: dict[str, list[tuple[str, Any]]] = {
    "n": [("1", 1), ("3", 3), ("max", 16), ("max+1", 17), ("zero", 0), ("negative", -1), ("int64", 2**63),
          ("string", "2"), ("float", 1.5)],
    "max_tokens": [("1", 1), ("24", 24), ("int32-1", 2**31 - 1), ("int32", 2**31), ("zero", 0), ("negative", -3),
                   ("null", None)],
    "min_tokens": [("4", 4), ("past max_tokens", 40), ("past context", 100_000), ("int32", 2**31), ("negative", -1)],
    "temperature": [("greedy", 0), ("denormal", 5e-324), ("1e-6", 1e-6), ("0.8", 0.8), ("max", 2), ("max+", 2.0001),
                    ("negative", -0.5), ("string", "hot")],
    "top_p": [("denormal", 5e-324), ("0.5", 0.5), ("1", 1), ("zero", 0), ("over", 1.5)],
    "top_k": [("off", -1), ("1", 1), ("int32-1", 2**31 - 1), ("int32", 2**31), ("under", -2)],
    "min_p": [("0.9", 0.9), ("1", 1), ("over", 1.1)],
    "seed": [("int64 min", -(2**63)), ("int64 max", 2**63 - 1), ("int64 max+1", 2**63), ("uint64 max", 2**64 - 1),
             ("10^30", 10**30), ("0", 0)],
    "repetition_penalty": [("denormal", 5e-324), ("max", 10), ("over", 10.5), ("zero", 0)],
    "presence_penalty": [("min", -2), ("max", 2), ("over", 2.5)],
    "frequency_penalty": [("min", -2), ("under", -2.5)],
    "logit_bias": [("ban eos", {"2": -100}), ("force", {"30": 100}), ("over", {"30": 101}), ("negative id", {"-1": 1}),
                   ("past vocab", {"99999999": 1}), ("int32", {str(2**31): 1}),
                   ("300 entries", {str(i): 0.5 for i in range(300)}), ("301 entries", {str(i): 1 for i in range(301)}),
                   ("not a number", {"5": "x"})],
    "stop": [("newline", ["\n"]), ("max length", "x" * 256), ("max+1 length", "x" * 257), ("16", ["ab"] * 16),
             ("17", ["ab"] * 17), ("empty", [""]), ("word", "the")],
    "stop_token_ids": [("eos", [2]), ("past vocab", [99_999_999]), ("int32", [2**31]), ("65", list(range(3, 68))),
                       ("negative", [-1])],
    "ignore_eos": [("true", True), ("string", "yes")],
    "stream": [("true", True)],
    "guided_regex": [("digits", "[0-9]{1,4}"), ("broken", "(("), ("70 kB", "a" * 70_000)],
    "guided_choice": [("two", ["yes", "no"]), ("empty", [])],
    "response_format": [
        ("json_object", {"type": "json_object"}),
        ("json_schema", {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}),
        ("strict", {"type": "json_schema", "json_schema": {"name": "v", "strict": True, "schema": SCHEMA}}),
        ("deep 40", {"type": "json_schema", "json_schema": {"name": "v", "strict": True, "schema": nested(40)}}),
        ("deep 300", {"type": "json_schema", "json_schema": {"name": "v", "schema": nested(300)}}),
        ("bad schema", {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "nope"}}}),
        ("bad type", {"type": "xml"}),
    ],
    "unknown": [("typo", ("temprature", 0.1)), ("vllm-only", ("vllm_xargs", {"a": 1})),
                ("template", ("chat_template", "{{ 7 * 7 }}"))],
}  # fmt: skip
CHAT: dict[str, list[tuple[str, Any]]] = {
    **SHARED,
    "logprobs": [("true", True), ("string", "yes")],
    "top_logprobs": [("0", 0), ("max", 20), ("max+1", 21)],
    "tools": [("one", [WEATHER]), ("two", [WEATHER, tool("get_time")]), ("129", [tool(f"f{i}") for i in range(129)]),
              ("bad name", [tool("bad name!")]), ("deep params", [tool("deep", nested(60))]),
              ("same name", [WEATHER, WEATHER])],
    "tool_choice": [("auto", "auto"), ("required", "required"), ("none", "none"),
                    ("named", {"type": "function", "function": {"name": "get_weather"}}),
                    ("unknown", {"type": "function", "function": {"name": "nope"}})],
    "parallel_tool_calls": [("false", False)],
    "messages": [
        ("long", [{"role": "user", "content": "word " * 1500}]),
        ("tool turns", [{"role": "user", "content": "weather?"},
                        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]),
        ("malformed tool_calls", [{"role": "user", "content": "x"},
                                  {"role": "assistant", "tool_calls": [{"function": {"arguments": 7}}]}]),
        ("200 turns", [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(200)]),
        ("empty role", [{"role": "", "content": "x"}]),
        ("image part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ("null content", [{"role": "user", "content": None}]),
        ("empty", []),
    ],
}  # fmt: skip
COMPLETION: dict[str, list[tuple[str, Any]]] = {
    **SHARED,
    "logprobs": [("0", 0), ("max", 20), ("max+1", 21)],
    "echo": [("true", True)],
    "best_of": [("n", 1), ("other", 2)],
    "prompt": [("64 prompts", [[5, 6, 7]] * 64), ("65 prompts", [[5, 6, 7]] * 65), ("strings", ["a b", "c d"]),
               ("empty list", []), ("empty ids", [[]]), ("int32 id", [[2**31]]), ("past vocab", [[99_999_999]]),
               ("long", "word " * 1500)],
}  # fmt: skip
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY}
TOOL_TURN = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # fmt: skip
# The Responses API at the gateway (issue 48): its own fields, translated to chat there.
RESPONSES: dict[str, list[tuple[str, Any]]] = {
    "input": [("text", "Say something."),
              ("parts", [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}]),
              ("tool turn", TOOL_TURN),
              ("dangling output", [{"type": "function_call_output", "call_id": "z", "output": "1"}]),
              ("unknown type", [{"type": "computer_call", "id": "x"}]),
              ("image", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
              ("empty", ""), ("long", "word " * 1500), ("500 items", [{"role": "user", "content": "hi"}] * 500),
              ("bad role", [{"role": "tool", "content": "x"}])],
    "instructions": [("short", "Be brief."), ("long", "rule " * 1500)],
    "tools": [("one", [RESP_TOOL]), ("hosted", [{"type": "web_search"}]),
              ("129", [{"type": "function", "name": f"f{i}"} for i in range(129)]),
              ("bad name", [{"type": "function", "name": "bad name!"}]),
              ("deep params", [{"type": "function", "name": "deep", "parameters": nested(60)}])],
    "tool_choice": [("auto", "auto"), ("required", "required"), ("named", {"type": "function", "name": "get_weather"}),
                    ("unknown", {"type": "function", "name": "nope"})],
    "text": [("json_object", {"format": {"type": "json_object"}}),
             ("schema", {"format": {"type": "json_schema", "name": "v", "schema": SCHEMA}}),
             ("no schema", {"format": {"type": "json_schema", "name": "v"}}),
             ("deep 300", {"format": {"type": "json_schema", "name": "v", "schema": nested(300)}}),
             ("bad type", {"format": {"type": "xml"}})],
    "max_output_tokens": [("1", 1), ("24", 24), ("zero", 0), ("int32", 2**31)],
    "temperature": [("greedy", 0), ("max+", 2.0001)],
    "top_p": [("zero", 0), ("0.5", 0.5)],
    "previous_response_id": [("unknown", "resp_nothere"), ("bad chars", "../../etc")],
    "store": [("false", False)],
    "stream": [("true", True)],
    "background": [("true", True)],
    "truncation": [("auto", "auto")],
    "metadata": [("16", {str(i): "v" for i in range(16)}), ("17", {str(i): "v" for i in range(17)})],
    "reasoning": [("high", {"effort": "high"})],
    "unknown": [("typo", ("temprature", 0.1))],
}  # fmt: skip
RESPONSES_BAD: dict[str, set[str]] = {
    "input": {"dangling output", "unknown type", "image", "empty", "long", "500 items", "bad role"},
    "instructions": {"long"}, "tools": {"hosted", "129", "bad name", "deep params"},
    "tool_choice": {"unknown", "required", "named"}, "text": {"no schema", "deep 300", "bad type"},
    "max_output_tokens": {"zero", "int32"}, "temperature": {"max+"}, "top_p": {"zero"},
    "previous_response_id": {"unknown", "bad chars"}, "background": {"true"}, "truncation": {"auto"},
    "metadata": {"17"},
}  # fmt: skip
BODIES = ["huge body", "deep body", "not json"]  # whole-body cases, drawn now and then instead of a request
# The values refused on their own: the sweep puts each value beside others that are not, so that
# what it gets is its own doing.
BAD: dict[str, set[str]] = {
    "n": {"max+1", "zero", "negative", "int64", "float"},
    "max_tokens": {"int32-1", "int32", "zero", "negative"},
    "min_tokens": {"past max_tokens", "past context", "int32", "negative"},
    "temperature": {"max+", "negative", "string"},
    "top_p": {"zero", "over"},
    "top_k": {"int32", "under"},
    "min_p": {"over"},
    "seed": {"int64 max+1", "uint64 max", "10^30"},
    "repetition_penalty": {"over", "zero"},
    "presence_penalty": {"over"},
    "frequency_penalty": {"under"},
    "logit_bias": {"over", "negative id", "past vocab", "int32", "301 entries", "not a number"},
    "stop": {"max+1 length", "17", "empty"},
    "stop_token_ids": {"past vocab", "int32", "65", "negative"},
    "guided_regex": {"broken", "70 kB"},
    "guided_choice": {"empty"},
    "response_format": {"deep 40", "deep 300", "bad schema", "bad type"},
    "logprobs": {"max+1"},
    "top_logprobs": {"max+1"},
    "tools": {"129", "bad name", "deep params", "same name"},
    "tool_choice": {"unknown", "required", "named"},  # required and named need tools
    "messages": {"long", "malformed tool_calls", "empty role", "image part", "empty"},
    "prompt": {"65 prompts", "empty list", "empty ids", "int32 id", "past vocab", "long"},
    "best_of": {"other"},
}


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses"}


@dataclass
class Hostile:
    kind: str  # chat | completion
    body: dict
    raw: bytes
    labels: dict[str, str]  # field -> the label of the value it got

    @property
    def path(self) -> str:
        return PATHS[self.kind]


def template(kind: str, model: str) -> dict:
    if kind == "responses":
        return {"model": model, "input": "Say something.", "max_output_tokens": 8}
    if kind == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 8}


def build(kind: str, model: str, choices: dict[str, tuple[str, Any]]) -> Hostile:
    """The request of `kind` with each field given its (label, value)."""
    body, labels = template(kind, model), {}
    for name, (label, value) in choices.items():
        labels[name] = label
        if name == "unknown":
            body[value[0]] = value[1]
        else:
            body[name] = value
    return Hostile(kind, body, json.dumps(body).encode(), labels)


def sweep(model: str, rng: random.Random) -> list[Hostile]:
    """Every value of every field once, in each endpoint, beside up to two other fields' values
    that are fine on their own, drawn by `rng`; and each whole-body case: what a fixed number of
    random examples would leave untried."""
    cases = []
    for kind, table in (("chat", CHAT), ("completion", COMPLETION)):
        for name in sorted(table):
            for choice in table[name]:
                others = rng.sample([f for f in sorted(table) if f != name], rng.randint(0, 2))
                fine = {f: rng.choice([c for c in table[f] if c[0] not in BAD.get(f, ())]) for f in others}
                cases.append(build(kind, model, {name: choice, **fine}))
        cases += [whole_body(build(kind, model, {}), which) for which in BODIES]
    return cases


def responses_sweep(model: str, rng: random.Random) -> list[Hostile]:
    """Every Responses value once, each beside a value of another field that is fine on its own
    (so what a refused value gets is its own doing), and the whole-body cases."""
    bad, fine = [], []
    for name in sorted(RESPONSES):
        for choice in RESPONSES[name]:
            (bad if choice[0] in RESPONSES_BAD.get(name, ()) else fine).append((name, choice))
    cases = []
    for name, choice in bad + fine:  # each beside a fine value of another field, drawn
        partner = rng.choice([(n, c) for n, c in fine if n != name])
        cases.append(build("responses", model, {name: choice, partner[0]: partner[1]}))
    return cases + [whole_body(build("responses", model, {}), which) for which in BODIES]


def whole_body(h: Hostile, which: str) -> Hostile:
    """`h` with its whole body replaced: too large, nested too deep, or cut (not JSON)."""
    raw = {"huge body": lambda: h.raw[:-1] + b', "pad": "' + b"x" * 4_200_000 + b'"}',
           "deep body": lambda: b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
           "not json": lambda: h.raw[: len(h.raw) // 2]}[which]()  # fmt: skip
    return Hostile(h.kind, h.body, raw, {"body": which})


@st.composite
def hostile(draw, model: str, kinds: tuple[str, ...] = ("chat", "completion")) -> Hostile:
    kind = draw(st.sampled_from(kinds))
    table = {"chat": CHAT, "completion": COMPLETION, "responses": RESPONSES}[kind]
    names = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=5, unique=True))
    built = build(kind, model, {name: draw(st.sampled_from(table[name])) for name in names})
    whole = draw(st.sampled_from([None] * 24 + BODIES))
    return built if whole is None else whole_body(built, whole)


def judge(h: Hostile, status: int, text: str) -> str | None:
    """Why the answer broke the rule, or None."""
    if status >= 500:
        return f"{status}: {text[:300]}"
    if status >= 400:
        return _refusal(h, status, text)
    if h.kind == "responses":
        return _response(h, text)
    if h.body.get("stream") is True and "body" not in h.labels:
        return _stream(h, text)
    try:
        answer = json.loads(text)
    except ValueError:
        return f"200 with a body that is not JSON: {text[:200]}"
    return _promise(h, answer.get("choices") or [])


def _response(h: Hostile, text: str) -> str | None:
    """A Response (or its event stream, in order, ending completed or incomplete) whose calls
    are of offered functions and whose finished text keeps its format."""
    if h.body.get("stream") is True:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        if [e.get("sequence_number") for e in events] != list(range(len(events))):
            return f"a Responses stream out of sequence: {[e.get('type') for e in events][:20]}"
        if not events or events[-1].get("type") not in ("response.completed", "response.incomplete"):
            return f"a Responses stream that ends in {events[-1] if events else None}"
        response = events[-1]["response"]
    else:
        try:
            response = json.loads(text)
        except ValueError:
            return f"200 with a body that is not JSON: {text[:200]}"
    if response.get("object") != "response" or response.get("status") not in ("completed", "incomplete"):
        return f"200 with a Response {response.get('status')!r}: {str(response)[:200]}"
    names = {t.get("name") for t in h.body.get("tools") or []}
    for item in response["output"]:
        if item["type"] != "function_call":
            continue
        if item["name"] not in names or not isinstance(json.loads(item["arguments"] or "{}"), dict):
            return f"a function call that is not one of the offered functions: {item}"
    fmt = (h.body.get("text") or {}).get("format") or {}
    content = "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])
    if response["status"] == "completed" and content and fmt.get("type") == "json_schema":
        try:
            jsonschema.validate(json.loads(content), fmt["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"a Response that breaks its text.format ({type(exc).__name__}): {content[:200]!r}"
    return None


def _refusal(h: Hostile, status: int, text: str) -> str | None:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without OpenAI's error shape: {text[:200]}"
    if status in (408, 413) or "body" in h.labels:
        return None  # the body itself: too large, too slow, too deep or not JSON
    param = error.get("param")
    root = str(param).split(".")[0] if param else None
    if root not in h.body:
        return f"{status} names {param!r}, not a field the request sent: {error.get('message', '')[:200]}"
    return None


def _expected_choices(h: Hostile) -> int:
    n = int(h.body.get("n", 1))  # a number in a string is taken, as pydantic (and vLLM) take it
    if h.kind == "chat":
        return n
    prompt = h.body.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return n * count


def _promise(h: Hostile, choices: list) -> str | None:
    if len(choices) != _expected_choices(h):
        return f"200 with {len(choices)} choices for {_expected_choices(h)} asked"
    for choice in choices:
        problem = _choice(h, choice)
        if problem:
            return problem
    return None


def _choice(h: Hostile, choice: dict) -> str | None:
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", "tool_calls"):
        return f"200 with finish_reason {finish!r}"
    if h.kind != "chat":
        return None
    message = choice.get("message") or {}
    names = {t["function"]["name"] for t in h.body.get("tools") or []}
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] not in names or not isinstance(json.loads(call["function"]["arguments"]), dict):
            return f"a tool call that is not one of the offered functions: {call}"
    if finish != "stop":
        return None
    return _constrained(h, message.get("content") or "")


def _constrained(h: Hostile, content: str) -> str | None:
    """A finished answer under a constraint is what the constraint allows, with nothing after it."""
    fmt, body = h.body.get("response_format") or {}, h.body
    try:
        if fmt.get("type") == "json_schema":
            jsonschema.validate(json.loads(content), fmt["json_schema"]["schema"])
        elif fmt.get("type") == "json_object" and not isinstance(json.loads(content), dict):
            return f"json_object answered {content[:100]!r}"
        if "guided_regex" in body and not re.fullmatch(body["guided_regex"], content):
            return f"guided_regex {body['guided_regex']!r} answered {content[:100]!r}"
        if "guided_choice" in body and content not in body["guided_choice"]:
            return f"guided_choice answered {content[:100]!r}"
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"a constrained answer that breaks its constraint ({type(exc).__name__}): {content[:200]!r}"
    return None


def _stream(h: Hostile, text: str) -> str | None:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"a stream that does not end with [DONE]: {text[-200:]!r}"
    for data in events[:-1]:
        chunk = json.loads(data)
        error = chunk.get("error")
        if error and error.get("type") != "invalid_request_error":
            return f"a stream ended by an engine error: {error}"
    return None


@dataclass
class Coverage:
    """Per field: the values tried (by label) and the statuses they got."""

    tried: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: int = 0

    def record(self, h: Hostile, status: int) -> None:
        self.examples += 1
        for name, label in h.labels.items():
            self.tried[name][label] += 1
            self.statuses[name][status] += 1

    def table(self) -> str:
        rows = [f"{'field':<20} {'values tried (label: times)':<90} statuses"]
        for name in sorted(self.tried):
            tried = ", ".join(f"{label}: {n}" for label, n in sorted(self.tried[name].items()))
            seen = " ".join(f"{s}x{n}" for s, n in sorted(self.statuses[name].items()))
            rows.append(f"{name:<20} {tried:<90} {seen}")
        return "\n".join(rows)
