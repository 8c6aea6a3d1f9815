"""A request's structured-output spec (common/openai_api.py StructuredSpec: kind and value) as
an llguidance grammar, and the limits it must keep.

NOTE: llguidance (not xgrammar) because it has no dependencies: xgrammar 0.2.8 requires
transformers and triton at run time, which the engine image does not otherwise need. llguidance
also bounds compilation by deterministic "fuel" (LLParserLimits), so a pathological grammar is an
error in milliseconds, not a stalled compile thread.
"""

from __future__ import annotations

import json
from typing import Any

from kvharbor.common.request_limits import RequestLimits, json_depth
from kvharbor.engine.core_io import StructuredOutputError

KINDS = ("json", "regex", "choice", "grammar")


class GrammarError(StructuredOutputError):
    """A spec that cannot be compiled or breaks a limit; the message says which and why."""


def grammar_for(spec: dict[str, Any], limits: RequestLimits) -> str:
    """The llguidance grammar of `spec` ({"kind": ..., "value": ...}). Raises GrammarError."""
    from llguidance import LLMatcher

    kind, value = spec.get("kind"), spec.get("value")
    check_limits(kind, value, limits)
    if kind == "json":
        try:  # compact JSON: no whitespace runs for a small model to loop in
            return LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        from llguidance import regex_to_lark

        # \d, \w and \s in ASCII, as Python's re.ASCII and xgrammar read them: Rust's regex is
        # Unicode-aware, and \d{3} gave a 135M model three Arabic-Indic digits.
        return LLMatcher.grammar_from_regex(regex_to_lark(value, "dws"))
    if kind == "choice":
        # Lark string literals take JSON's escapes, so each choice is matched exactly as given.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        if "::=" in value:  # GBNF / EBNF as llama.cpp and xgrammar write it
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                value = gbnf_to_lark(value)
            except Exception as exc:  # the converter raises its own error types
                raise GrammarError(f"invalid EBNF grammar: {exc}") from None
        return LLMatcher.grammar_from_lark(value)
    raise GrammarError(f"structured output kind must be one of {', '.join(KINDS)}, not {kind!r}")


def check_limits(kind: str, value: Any, limits: RequestLimits) -> None:
    """Nesting and size limits (structured_max_depth, structured_max_bytes), checked before any
    compile, so an oversized spec costs nothing. The HTTP edges check the same limits on the
    request (common/request_body.py); this is the check for offline callers."""
    if kind == "json" and json_depth(value, limits.structured_max_depth + 1) > limits.structured_max_depth:
        raise GrammarError(  # first: measuring the size would recurse through every level
            f"the JSON schema nests more than {limits.structured_max_depth} levels deep, over this engine's limit "
            "(structured_max_depth)"
        )
    size = len(json.dumps(value)) if kind in ("json", "choice") else len(str(value))
    if size > limits.structured_max_bytes:
        raise GrammarError(
            f"the {kind} spec is {size} bytes, over this engine's limit of {limits.structured_max_bytes} "
            "(structured_max_bytes)"
        )
    if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
