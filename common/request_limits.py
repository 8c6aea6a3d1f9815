"""Bounds on what one request may ask for (common/request_body.py checks a body against them).

RequestLimits is a sub-config of the gateway's and the engine's configs, so each limit has one name
in flags, YAML and KVHARBOR_* variables on both (`--max-prompts 64`, `max_prompts: 64`,
`KVHARBOR_MAX_PROMPTS=64`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvharbor.common.config import opt
from kvharbor.common.sampling_limits import MAX_CONTINUED_TEXT

# Levels of a body around a JSON schema: body > tools > [i] > function > parameters (a schema at
# level 5), or an assistant's message > tool_calls > [i] > function > arguments. A body may nest
# this much deeper than structured_max_depth lets a schema nest.
ENVELOPE_DEPTH = 6
MAX_STRUCTURED_DEPTH = 128  # recursion over a schema (strict mode's closed_objects) stays far from Python's limit


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (a 400 naming the field and the limit above each)."""

    max_n: int = opt(16, "largest n (parallel samples, and best_of) one request may ask for")
    max_prompts: int = opt(
        64, "most prompts one completions request may carry (each takes a concurrency slot at the gateway)"
    )
    max_stop_strings: int = opt(16, "most stop strings one request may give")
    max_stop_length: int = opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = opt(64, "most stop_token_ids one request may give")
    max_logit_bias: int = opt(300, "most logit_bias entries one request may give")
    max_tools: int = opt(128, "most tools one request may offer the model")
    structured_max_bytes: int = opt(
        65536, "largest JSON schema (a tool's parameters too), regex, choice list or grammar a request may send"
    )
    structured_max_depth: int = opt(32, "deepest nesting a request's JSON schema may have")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts", "max_stop_strings", "max_stop_token_ids", "max_logit_bias", "max_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_stop_length <= MAX_CONTINUED_TEXT:
            # A migrated stream carries its held-back text (shorter than its longest stop string).
            raise ValueError(f"max_stop_length must be in 1..{MAX_CONTINUED_TEXT}, got {self.max_stop_length}")
        if self.structured_max_bytes < 16:
            raise ValueError(f"structured_max_bytes must be >= 16, got {self.structured_max_bytes}")
        if not 2 <= self.structured_max_depth <= MAX_STRUCTURED_DEPTH:
            depth = self.structured_max_depth
            raise ValueError(f"structured_max_depth must be in 2..{MAX_STRUCTURED_DEPTH}, got {depth}")

    @property
    def max_body_depth(self) -> int:
        return self.structured_max_depth + ENVELOPE_DEPTH


def json_depth(value: Any, stop_at: int | None = None) -> int:
    """Nesting depth of a JSON value (a scalar: 0, [] or {}: 1), walked without recursion;
    it stops counting at `stop_at`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if not isinstance(node, dict | list):
            continue
        deepest = max(deepest, depth)
        if stop_at is not None and deepest >= stop_at:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        todo.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest
