"""kvharbor engine: paged continuous batching with prefix caching over Llama-family models.

from kvharbor.engine import LLM, SamplingParams
llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from kvharbor.engine import omp_policy as _omp_policy  # noqa: F401  first: before anything loads torch
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
