"""The ranges of the sampling options, in one place: the OpenAI request models check them
(pydantic, so a 400 names the field) and the engine's SamplingParams checks them again for
offline callers, from this same table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limit:
    low: float
    high: float
    low_open: bool = False  # low itself is not allowed

    def allows(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return bool(above and value <= self.high)  # NaN fails both

    def describe(self) -> str:
        return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"

    def field(self) -> dict[str, float]:
        """pydantic Field bounds."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


# OpenAI's ranges where OpenAI has one; vLLM's names and ranges for its extensions.
TEMPERATURE = Limit(0.0, 2.0)
TOP_P = Limit(0.0, 1.0, low_open=True)
MIN_P = Limit(0.0, 1.0)
PRESENCE_PENALTY = Limit(-2.0, 2.0)
FREQUENCY_PENALTY = Limit(-2.0, 2.0)
REPETITION_PENALTY = Limit(0.0, 10.0, low_open=True)
LOGIT_BIAS = Limit(-100.0, 100.0)  # anything else (inf, NaN) would turn a whole row into NaN
# A seed is a signed 64-bit integer, as OpenAI's API and vLLM define it: it crosses the engine's
# core link as msgpack int64, and sample i of n draws from seed + i (wrapped, engine/sampler.py).
SEED = Limit(-(2**63), 2**63 - 1)
MAX_LOGPROBS = 20
MAX_CONTINUED_TEXT = 1024  # a migrated stream's held-back text: shorter than its longest stop string
