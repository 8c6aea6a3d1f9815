"""LLMEngine: the engine core and its output processor in one process, for offline use and tests.

    add_request(id, prompt text or token ids)  ->  core.add_request(id, token ids)
    step()  ->  core outputs (token ids)  ->  OutputProcessor  ->  RequestOutputs with text
                                          <-  stops at stop strings, told to the core at once

It is the core class itself (EngineCore), with text at its edges: `kvharbor serve` runs the same
core in a process of its own and the processor in the API server.
"""

from __future__ import annotations

from kvharbor.engine.core import EngineCore, EngineStats, Progress
from kvharbor.engine.output_processor import OutputProcessor
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Progress"]


class LLMEngine(EngineCore):
    def __init__(self, config, progress: Progress | None = None, loaded_model=None) -> None:
        super().__init__(config, progress, loaded_model)
        self.processor = OutputProcessor(self.tokenizer)

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
        name), as EngineCore's."""
        params = params or SamplingParams()
        if prompt_token_ids is None and prompt is not None:
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: send prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(prompt)
        super().add_request(
            request_id, prompt_token_ids, params, priority=priority, tenant=tenant, cache_salt=cache_salt,
            arrival_time=arrival_time, hand_off=hand_off, first_token=first_token, lora=lora,
        )  # fmt: skip
        self.processor.add(request_id, prompt, list(prompt_token_ids), params)

    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for every request that progressed or finished."""
        outputs, stops = self.processor.process(super().step())
        for stop in stops:
            self.stop_sample(stop.request_id, stop.index, stop.num_output_tokens, stop.stop_string)
        return outputs
