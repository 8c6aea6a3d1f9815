"""Reasoning apart from the answer, by vLLM's `--reasoning-parser` names (common/model_families.py
picks one per family): a chat answer's `reasoning` field, and the Responses API's reasoning item.

    qwen3        <think>...</think> then the answer; an output that does not open with <think>
                 is all answer (Qwen3 with thinking off)
    deepseek_r1  the prompt opens <think>: the output is reasoning until </think>

An output cut short inside its reasoning is all reasoning. `ReasoningStream` splits a stream's
text deltas the same way, holding back only what could still be a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass
class ReasoningStream:
    """One sample's text, delta by delta: `delta` gives (reasoning, content) to send now."""

    parser: str
    _state: str = "start"  # start (not known yet) | reasoning | content
    _held: str = ""
    _trim: bool = False  # the answer's leading blank lines (after </think>) are not sent

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}; kvharbor parses {', '.join(PARSERS)}")

    def delta(self, text: str, finished: bool = False) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._state == "start":
            head = self._held.lstrip()
            if head.startswith(THINK_OPEN):
                self._state, self._held = "reasoning", head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head) and not finished:
                return "", ""  # could still open a think block
            else:  # deepseek_r1's prompt opened the block already
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = self._held.find(THINK_CLOSE)
            if end >= 0:
                reasoning, self._held = self._held[:end], self._held[end + len(THINK_CLOSE) :]
                self._state, self._trim = "content", True
            else:
                keep = 0 if finished else _partial(self._held, THINK_CLOSE)
                reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                return reasoning, ""
        if self._state == "content":
            if self._trim:
                self._held = self._held.lstrip()
                self._trim = not self._held
            content, self._held = self._held, ""
        return reasoning, content


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole output."""
    reasoning, content = ReasoningStream(parser).delta(text, finished=True)
    return reasoning or None, content


def _partial(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
