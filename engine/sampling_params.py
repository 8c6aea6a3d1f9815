"""SamplingParams: how one request turns logits into tokens, and when it stops (vLLM's names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvharbor.common import sampling_limits as lim
from kvharbor.common.field_error import FieldError

_RANGED = {
    "temperature": lim.TEMPERATURE,
    "top_p": lim.TOP_P,
    "min_p": lim.MIN_P,
    "repetition_penalty": lim.REPETITION_PENALTY,
    "presence_penalty": lim.PRESENCE_PENALTY,
    "frequency_penalty": lim.FREQUENCY_PENALTY,
}


GREEDY_BELOW = 1e-5  # temperatures under this sample the argmax (see SamplingParams.greedy)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options. `validate()` raises ValueError on bad values.

    temperature 0 is greedy. `seed` makes a request reproducible whatever else is batched with it.
    `logprobs=k` returns the sampled token's log-probability plus the k most likely (0: only the
    sampled one); they are log-softmax of the raw model logits, before penalties and temperature.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    speculative: bool = True  # False: this request opts out of the engine's speculative decoding
    # A migrated stream's text the client has not had yet (the last engine held it back: it could
    # start a stop string): it opens this output, and stop strings are searched across it.
    continued_text: str = ""
    # Structured output: {"kind": "json" | "regex" | "choice" | "grammar", "value": ...}
    # (common/openai_api.py builds it; engine/structured/ compiles it). None: free text.
    structured: dict | None = None
    continued_tokens: int = 0  # a migrated stream's output so far, at the prompt's end (its grammar walks it)
    # An embedding, not a generation (engine/pooling.py): "last" | "mean". The request ends after
    # its prompt with its pooled hidden state; it samples nothing.
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: dict) -> SamplingParams:
        """Params that crossed the core link: validated once, when the API server built them, and
        not again (the core trusts its typed input). KeyError or TypeError for a malformed dict."""
        params = cls.__new__(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != known:
            raise TypeError(f"sampling params on the wire must have exactly the fields {sorted(known)}")
        params.__dict__.update(fields)
        return params

    @property
    def greedy(self) -> bool:
        # NOTE: logits / 1e-181 overflow to inf and softmax gives NaN (the fuzz test's 500); below
        # GREEDY_BELOW a temperature picks the argmax anyway, so it is greedy (vLLM's rule too).
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            field = msg.split(" ", 1)[0].split("=", 1)[0]  # every message opens with the field's name
            return FieldError(field, f"invalid sampling parameter: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.continued_text, str) or len(self.continued_text) > lim.MAX_CONTINUED_TEXT:
            raise bad(f"continued_text must be a string of at most {lim.MAX_CONTINUED_TEXT} characters")
        if self.continued_text and self.n != 1:
            raise bad("continued_text continues one sample: it needs n = 1")
        if self.structured is not None and not (
            isinstance(self.structured, dict) and set(self.structured) == {"kind", "value"}
            and self.structured["kind"] in ("json", "regex", "choice", "grammar")
        ):  # fmt: skip
            raise bad('structured must be {"kind": json|regex|choice|grammar, "value": ...}')
        if self.pooling is not None and self.pooling not in ("last", "mean"):
            raise bad(f'pooling must be "last" or "mean", got {self.pooling!r}')
        if self.pooling is not None and (self.n != 1 or self.max_tokens != 1 or self.structured is not None):
            raise bad("pooling requests take n = 1, max_tokens = 1 and no structured output")
        if not isinstance(self.continued_tokens, int) or self.continued_tokens < 0:
            raise bad(f"continued_tokens must be an integer >= 0, got {self.continued_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in _RANGED:
            limit, value = _RANGED[name], getattr(self, name)
            if not limit.allows(value):  # also rejects NaN
                raise bad(f"{name} must be {limit.describe()}, got {value!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= lim.MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be an integer in [0, {lim.MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool):
                    raise bad(f"logit_bias keys must be integer token ids, got {tok!r}")
                if not lim.LOGIT_BIAS.allows(bias):
                    limit = lim.LOGIT_BIAS.describe()
                    raise bad(f"logit_bias values must be numbers {limit}, got {bias!r} for token {tok}")
        if not isinstance(self.speculative, bool):
            raise bad(f"speculative must be true or false, got {self.speculative!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not lim.SEED.allows(self.seed)
        ):
            raise bad(f"seed must be a signed 64-bit integer, {lim.SEED.describe()}, got {self.seed!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id named by these params is outside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {}))):
            for tok in ids:
                if not 0 <= int(tok) < vocab_size:
                    raise FieldError(name, f"{name}: token id {tok} is outside the vocabulary [0, {vocab_size})")
