"""Compiled grammars, cached per spec, and the Guide that follows one sample through them.

A Guide masks a step's logits to the tokens its grammar allows next and advances on the token the
sample took. n > 1 samples fork it (each sample then walks its own path); a preempted request
keeps it, since its output tokens are kept. When the grammar is complete only EOS stays allowed.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvharbor.common.request_limits import RequestLimits
from kvharbor.engine.config import StructuredConfig
from kvharbor.engine.structured.grammar import GrammarError, grammar_for


class Guide:
    """One sample's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, kind: str) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self.kind = kind

    def allowed(self) -> torch.Tensor:
        """A bool [vocab] of the tokens the grammar takes next (EOS alone once it is complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool))

    def advance(self, token: int) -> None:
        """The sample took `token` (one the mask allowed, or EOS)."""
        self._matcher.consume_token(token)

    def fork(self) -> Guide:
        return Guide(self._matcher.deep_copy(), self._vocab, self.kind)

    @property
    def complete(self) -> bool:
        """The grammar can take nothing more: the sample is done."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GuideFactory:
    """Compiles specs for one tokenizer; thread-safe, so compiles run off the engine's step thread.
    `on_compile(seconds, hit)` is told of every lookup."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], config: StructuredConfig,
        limits: RequestLimits | None = None, on_compile: Callable[[float, bool], None] | None = None,
    ) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_token_ids)
        self.config = config
        self.limits = limits or RequestLimits()
        self.on_compile = on_compile  # the core's, for its counter board
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def guide(self, spec: dict[str, Any]) -> Guide:
        """A fresh Guide at the start of `spec`'s grammar. Raises GrammarError (a ValueError)."""
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        t0 = time.perf_counter()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        hit = template is not None
        if template is None:
            template = self._compile(spec)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > self.config.structured_cache_size:
                    self._cache.popitem(last=False)
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - t0, hit)
        return Guide(template.deep_copy(), self._vocab, spec["kind"])

    def prepare(self) -> None:
        """Build the grammar tokenizer now (a server does, in the background, after start-up), so
        the first constrained request does not wait ~0.5 s for it. Without a tokenizer: nothing."""
        if self._tokenizer is not None:
            self._tokenizer_for_grammars()

    def _compile(self, spec: dict[str, Any]) -> Any:
        from llguidance import LLMatcher

        grammar = grammar_for(spec, self.limits)
        matcher = LLMatcher(self._tokenizer_for_grammars(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec['kind']} spec: {_reason(matcher.get_error())}")
        return matcher

    def _tokenizer_for_grammars(self) -> Any:
        # Built once, on first use (~0.6 s for SmolLM2's 49k tokens), then shared by every grammar.
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise GrammarError("this model has no tokenizer, which structured outputs need")
                from llguidance import LLTokenizer

                self._ll_tokenizer = LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab, eos_token=self._eos
                )
            return self._ll_tokenizer


def _reason(message: str) -> str:
    """llguidance's error without the dump of the grammar's source that follows it (lines like
    `   1 | start: ...` and their `^` markers): the client needs the reason."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    kept = [ln for ln in lines if ln and not re.match(r"^(\d+\s*\||\^|\|)", ln)]
    return " ".join(kept)[:500] or "rejected by the grammar compiler"
