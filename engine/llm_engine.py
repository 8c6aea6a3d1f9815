"""LLMEngine: the engine core and its output processor in one process, for offline use and tests.

    add_request(id, prompt text or token ids)  ->  core.add_request(EngineRequest of token ids)
    step()  ->  core outputs (token ids)  ->  OutputProcessor  ->  RequestOutputs with text
                                          <-  stops at stop strings, told to the core at once

It holds an EngineCore (`core`) and puts text at its edges: `kvharbor serve` runs the same core
in a process of its own and the processor in the API server. It forwards nothing: the core's parts
are read where they are (`engine.core.kv`, `engine.core.scheduler`).
"""

from __future__ import annotations

import time

from kvharbor.engine.core import EngineCore, Progress
from kvharbor.engine.core_io import EngineRequest, KVTransfer
from kvharbor.engine.engine_stats import EngineStats
from kvharbor.engine.output_processor import OutputProcessor
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.request import check_request_id
from kvharbor.engine.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Progress"]

class LLMEngine:
    def __init__(self, config, progress: Progress | None = None, loaded_model=None, kv_save=None) -> None:
        self.core = EngineCore(config, progress, loaded_model, kv_save)
        self.processor = OutputProcessor(self.core.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        hand_off: str | None = None,
        first_token: int | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request given as text (tokenized here) or token ids. Raises ValueError (and
        queues nothing) for bad input. `hand_off` and `first_token`: P/D, and `lora` (an adapter's
        name), as in EngineCore.add_request."""
        check_request_id(request_id)  # the offline edge (the HTTP one: common/openai_api.request_id)
        params = params or SamplingParams()
        if prompt_token_ids is None and prompt is not None:
            if self.core.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: send prompt_token_ids instead of text")
            prompt_token_ids = self.core.tokenizer.encode(prompt)
        transfer = None
        if hand_off is not None or first_token is not None:
            transfer = KVTransfer(do_remote_decode=hand_off is not None, lease=hand_off, first_token_id=first_token)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = EngineRequest(request_id, prompt_token_ids, params, priority, tenant, cache_salt, arrival, lora,
                                transfer=transfer)  # fmt: skip
        self.core.add_request(request)
        self.processor.add(request_id, prompt, list(prompt_token_ids), params)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests (by id, or a list of them); each ends with finish_reason "abort"."""
        self.core.abort(request_ids)

    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for every request that progressed or finished."""
        outputs, stops = self.processor.process(self.core.step())
        for stop in stops:
            self.core.stop_sample(stop.request_id, stop.index, stop.num_output_tokens, stop.stop_string)
        return outputs
