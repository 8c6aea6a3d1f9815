"""Speculative decoding proposers, behind one interface, and the adaptive k.

A proposer looks at decoding requests and proposes up to k tokens for each; the target model
then scores them in the step's one forward pass (engine/runner.py) and engine/rejection.py keeps
what the target's own distribution would have produced. `Proposal.probs` is the draft
distribution q per proposed token, or None for a deterministic proposer (q = delta).

- `NgramProposer` (prompt lookup): find the latest earlier occurrence of the request's last n
  tokens (n = ngram_n down to 2) in its prompt and output, and propose what followed. No model:
  it costs microseconds and wins where text repeats (edits, code, summaries, quoting).
- `DraftModelProposer` (engine/spec/draft.py): a smaller model with the target's tokenizer and its
  own paged KV.

`AdaptiveK` gives each request its k: the full k while its recent acceptance is good, fewer as it
drops, and none (with a probe now and then) when proposals keep being rejected, since every
rejected token still costs the target a token of compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvharbor.engine.request import Request

SEARCH_WINDOW = 4096  # tokens searched back for an n-gram match: bounds the cost per step


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] draft distributions; None: deterministic


class Proposer(Protocol):
    def propose(self, requests: list[Request], ks: dict[str, int]) -> dict[str, Proposal]:
        """Up to ks[request_id] tokens for each of `requests` (all decoding: one token to run)."""

    def release(self, request: Request) -> None:
        """Forget a finished request (a draft model frees its KV)."""


class TokenIndex:
    """Where each token occurs in one request's tokens, extended as they grow (they never shrink)."""

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.length = 0

    def update(self, tokens: list[int]) -> None:
        for i in range(self.length, len(tokens)):
            self.positions.setdefault(tokens[i], []).append(i)
        self.length = len(tokens)


def ngram_lookup(tokens: list[int], max_n: int, k: int, index: TokenIndex | None = None) -> list[int]:
    """What followed the latest earlier occurrence of the last n tokens (n from max_n down to 2;
    1 when max_n is 1), at most k tokens; [] when nothing matches."""
    if k <= 0 or len(tokens) < 2:
        return []
    if index is None:
        index = TokenIndex()
    index.update(tokens)
    floor = len(tokens) - SEARCH_WINDOW
    # Latest occurrences of the last token first (recent context predicts best), the final one excluded.
    ends = [e for e in reversed(index.positions.get(tokens[-1], [])) if floor <= e < len(tokens) - 1]
    for n in range(min(max_n, len(tokens) - 1), 1 if max_n > 1 else 0, -1):
        suffix = tokens[-n:]
        for end in ends:
            if end - n + 1 >= 0 and tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


class NgramProposer:
    def __init__(self, n: int) -> None:
        self.n = n
        self._indexes: dict[str, TokenIndex] = {}

    def propose(self, requests: list[Request], ks: dict[str, int]) -> dict[str, Proposal]:
        out = {}
        for request in requests:
            index = self._indexes.setdefault(request.request_id, TokenIndex())
            tokens = ngram_lookup(request.all_token_ids, self.n, ks.get(request.request_id, 0), index)
            if tokens:
                out[request.request_id] = Proposal(tokens)
        return out

    def release(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)


class AdaptiveK:
    """Per-request k from an EWMA of its acceptance rate (accepted / proposed)."""

    def __init__(self, k: int, off_below: float = 0.2, probe_every: int = 16) -> None:
        self.k = k
        self.off_below = off_below
        self.probe_every = probe_every
        self._rate: dict[str, float] = {}
        self._idle: dict[str, int] = {}

    def k_for(self, request: Request) -> int:
        rid = request.request_id
        rate = self._rate.get(rid, 1.0)  # optimistic until measured
        if rate < self.off_below:
            self._idle[rid] = self._idle.get(rid, 0) + 1
            return 1 if self._idle[rid] % self.probe_every == 0 else 0  # a probe, to notice recovery
        return max(1, round(self.k * min(1.0, rate * 1.5)))

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        if proposed:
            rid = request.request_id
            self._rate[rid] = 0.7 * self._rate.get(rid, 1.0) + 0.3 * accepted / proposed

    def forget(self, request: Request) -> None:
        self._rate.pop(request.request_id, None)
        self._idle.pop(request.request_id, None)
