"""Incremental detokenization with stop strings, for one sample of one request.

Text is decoded token by token (multi-byte characters wait for their last byte). When stop strings
exist, the last `max(len(stop)) - 1` characters are held back from the stream until they cannot
be the start of a stop string, so a client never sees half of one. A migrated stream's held-back
text (`continued_text`, from the gateway) opens the text: it is handed out and searched as if this
engine had decoded it, so a stop string that straddles the break is still found.
"""

from __future__ import annotations

from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.sampling_params import SamplingParams


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._stream = tokenizer.decode_stream(params.skip_special_tokens) if tokenizer else None
        self.text = params.continued_text  # everything decoded so far, cut at a stop string once one is found
        self._emitted = 0  # characters of `text` already handed out as deltas
        self._searched = 0  # characters of `text` already searched for stop strings
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.stop_string: str | None = None
        self.stop_at: int | None = None  # output tokens up to the one that completed the stop string
        self.num_tokens = 0  # output tokens decoded so far

    def update(self, output_token_ids: list[int]) -> str | None:
        """Decode the tokens appended since the last call; return the stop string they completed,
        if any (the text is then cut there and later tokens are ignored)."""
        first = self.num_tokens
        self.num_tokens = len(output_token_ids)
        if self._stream is None or self.stop_string is not None:
            return None
        for count, token in enumerate(output_token_ids[first:], start=first + 1):
            piece = self._stream.step(self.tokenizer.backend, token)
            if not piece:
                continue
            self.text += piece
            if not self.params.stop:
                continue
            if count <= self.params.min_tokens:  # as vLLM: no stop string before min_tokens
                self._searched = len(self.text)
            elif self._find_stop():
                self.stop_at = count  # tokens after this one (a speculated run) are dropped
                return self.stop_string
        return None

    def _find_stop(self) -> bool:
        start = max(0, self._searched - self._hold)
        best = None
        for stop in self.params.stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        self._searched = len(self.text)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.stop_string = stop
        return True

    def delta(self, final: bool) -> str:
        """Text not handed out yet; while unfinished, keep back what may start a stop string."""
        end = (
            len(self.text) if final or self.stop_string is not None else max(self._emitted, len(self.text) - self._hold)
        )
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
