"""kvharbor engine: paged continuous batching with prefix caching over Llama-family models.

from kvharbor.engine import LLM, SamplingParams
llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

import os as _os
import sys as _sys

# NOTE: OpenMP threads that spin while idle collapse CPU decode ~10x on a busy 2-core machine
# (measured: 1.6 tok/s instead of ~14 at torch's default two threads), but threads that sleep at
# once pay a futex wake-up per parallel region: ~0.4 ms for an RMSNorm of 64 rows, ~15% of a decode
# step. A short spin (GOMP_SPINCOUNT, ~1 ms at most) before sleeping keeps both costs small. Both
# are read once, when torch loads OpenMP.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from kvharbor.engine.config import EngineConfig
from kvharbor.engine.outputs import CompletionOutput, RequestOutput
from kvharbor.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # NOTE: LLM and LLMEngine load torch; the API server of `kvharbor serve` imports this package
    # but only talks to its engine core process, so they load on first use, not with the package.
    if name == "LLM":
        from kvharbor.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvharbor.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
