"""kvharbor engine: paged continuous batching with prefix caching over Llama-family models.

from kvharbor.engine import LLM, SamplingParams
llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

import os as _os
import sys as _sys

# NOTE: OpenMP threads that spin while idle collapse CPU decode ~10x on a busy 2-core machine
# (FACTS.md). The policy is read once, when torch loads OpenMP, so set it before torch is imported.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvharbor.engine.config import EngineConfig
from kvharbor.engine.llm import LLM
from kvharbor.engine.llm_engine import LLMEngine
from kvharbor.engine.outputs import CompletionOutput, RequestOutput
from kvharbor.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
