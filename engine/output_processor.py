"""OutputProcessor: the core's token deltas -> RequestOutputs with text, stop strings applied.

It runs where the text is wanted: beside the core in the offline engine, and in the API server's
process for `kvharbor serve`. When a stop string ends a sample it cuts the sample there and asks
the caller to tell the core (`StopAt`), which retires the sample at that token.

Token lists and logprobs grow in place: an unfinished RequestOutput shares them with the next one
(copying them every step would be O(L^2) per stream); `delta_*` fields say what is new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.core_io import CoreOutput, Failure, SampleDelta
from kvharbor.engine.detokenizer import Detokenizer
from kvharbor.engine.outputs import CompletionOutput, RequestOutput
from kvharbor.engine.request import Logprob
from kvharbor.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopAt:
    """Tell the core: sample `index` of `request_id` ended after `num_output_tokens` (a stop string)."""

    request_id: str
    index: int
    num_output_tokens: int
    stop_string: str


@dataclass
class _Sample:
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    reported: int = 0  # tokens already handed out as a delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # a pooling request's vector, once its prompt ran
    error: Failure | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Tracked] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = _Tracked(prompt, prompt_token_ids, params)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def forget_all(self) -> None:
        self._requests.clear()

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[StopAt]]:
        """RequestOutputs for the requests these outputs move (unknown ids are ignored: aborted or
        already finished here), and the stops the core must be told of. A finished request is
        forgotten."""
        results, stops = [], []
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            tracked.num_cached_tokens, tracked.error = out.num_cached_tokens, out.error
            if out.embedding is not None:
                tracked.embedding = out.embedding
            for delta in out.samples:
                stop = self._apply(tracked, delta)
                if stop is not None:
                    stops.append(StopAt(out.request_id, delta.index, *stop))
            result = self._output(out.request_id, tracked, out.finished)
            if result.finished:
                del self._requests[out.request_id]
            results.append(result)
        return results, stops

    def _apply(self, tracked: _Tracked, delta: SampleDelta) -> tuple[int, str] | None:
        sample = tracked.samples.get(delta.index)
        if sample is None:
            sample = tracked.samples[delta.index] = _Sample(Detokenizer(self.tokenizer, tracked.params))
        if sample.finish_reason is not None:
            return None  # a stop string ended it here already; what the core ran after is dropped
        sample.token_ids += delta.new_token_ids
        sample.logprobs += delta.new_logprobs
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
        ids = sample.token_ids
        if sample.finish_reason == "stop" and not tracked.params.include_stop_str_in_output:
            ids = ids[:-1]  # EOS or a stop token id ended it: its text is not part of the answer
        stop = sample.detok.update(ids)
        if stop is None:
            return None
        cut = sample.detok.stop_at
        del sample.token_ids[cut:]
        del sample.logprobs[cut:]
        running = sample.finish_reason is None  # else the same token also hit a limit: the string wins
        sample.finish_reason, sample.stop_reason = "stop", stop
        return (cut, stop) if running else None

    def _output(self, request_id: str, tracked: _Tracked, core_finished: bool) -> RequestOutput:
        params = tracked.params
        first = tracked.samples.get(0)
        outs = []
        for index in range(params.n):
            sample = tracked.samples.get(index)
            if sample is None:  # not forked yet: an empty sample, ended if the request was
                reason = first.finish_reason if core_finished and first is not None else None
                outs.append(CompletionOutput(index, finish_reason=reason))
                continue
            done, sample.reported = sample.reported, len(sample.token_ids)
            ended = sample.finish_reason is not None
            outs.append(
                CompletionOutput(
                    index=index,
                    text=sample.detok.text,
                    token_ids=sample.token_ids,
                    logprobs=sample.logprobs if params.logprobs is not None else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    delta_text=sample.detok.delta(final=ended),
                    delta_token_ids=sample.token_ids[done:],
                    delta_logprobs=sample.logprobs[done:],
                )
            )
        finished = core_finished or all(o.finish_reason is not None for o in outs)
        return RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=tracked.num_cached_tokens,
            error=tracked.error,
            embedding=tracked.embedding,
        )
