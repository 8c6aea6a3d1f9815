"""Iteration-level scheduler: one token budget per step, no prefill or decode phases.

Each request's `num_computed_tokens` chases its `num_tokens`. A step gives every running request
what it still needs (1 token when decoding, a chunk when prefilling), then admits waiting requests,
longest cached prefix first skipped, while the budget, the sequence limit and the pool allow.

Control flow, driven by LLMEngine:
    plan = scheduler.schedule();  output = runner.execute(plan);  scheduler.update(plan, output)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvharbor.engine.config import SchedulerConfig
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import FinishReason, Logprob, Request, RequestStatus, sample_id


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request` starting at position `start` run this step.

    | start (already computed) | num_tokens (this step) | rest |
    """

    request: Request
    start: int
    num_tokens: int
    num_samples: int  # tokens to sample after this chunk: 0 mid-prefill, n on the first sample

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepOutput:
    """What the runner sampled: for each request id, the new tokens (n of them on a fork)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)


class Scheduler:
    """Owns the waiting and running queues. Higher `priority` runs first; among equals, the tenant
    with fewer running requests, then the earlier arrival. Preemption recomputes: the victim's
    blocks are freed (its prefix stays cached) and it waits again with its tokens kept."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Retire `request`: its blocks go back to the pool at once. Idempotent."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self.requests[request.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- scheduling -------------------------------------------------------------------------

    def _rank(self) -> Callable[[Request], tuple]:
        tenants = Counter(r.tenant for r in self.running)
        return lambda r: (-r.priority, tenants[r.tenant], r.arrival_time)

    def _sort_running(self) -> None:
        self.running.sort(key=lambda r: (-r.priority, r.arrival_time))

    def _preempt(self, victim: Request, plan: SchedulerPlan) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        plan.preempted.append(victim)

    def schedule(self) -> SchedulerPlan:
        """Choose this step's work. Mutates queues, tables and each request's status."""
        plan = SchedulerPlan()
        budget = self.config.max_num_batched_tokens
        self._sort_running()
        self._preempt_for_priority(plan)
        num_preempted = len(plan.preempted)
        budget = self._schedule_running(plan, budget)
        if len(plan.preempted) == num_preempted:  # NOTE: a pool that just forced preemption admits nobody
            self._schedule_waiting(plan, budget)
        return plan

    def _preempt_for_priority(self, plan: SchedulerPlan) -> None:
        # A waiting request that outranks the lowest running one takes its place when the batch or
        # the pool is full, but only if it could then run this very step: otherwise the victim's
        # work would be thrown away for nothing.
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=self._rank())
        hit = self.kv.get_computed_blocks(best)
        while self.running and self.running[-1].priority < best.priority:
            others = self.running[:-1]
            budget = self.config.max_num_batched_tokens - sum(r.num_tokens - r.num_computed_tokens for r in others)
            if budget <= 0:
                return
            chunk = min(best.num_tokens - hit.num_tokens, budget)
            full = len(self.running) >= self.config.max_num_seqs
            short = self.kv.blocks_needed(best, chunk, hit) > self.kv.num_free_blocks
            if not (full or short):
                return
            self._preempt(self.running[-1], plan)

    def _schedule_running(self, plan: SchedulerPlan, budget: int) -> int:
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(request, num_new)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
                copies = self.kv.allocate_slots(request, num_new)
            if copies is None:
                break
            plan.block_copies.extend(copies)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, plan: SchedulerPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = min(self.waiting, key=self._rank())
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            copies = self.kv.allocate_slots(request, num_new, hit)
            if copies is None:
                break  # NOTE: head-of-line blocking keeps priority order strict
            self.waiting.remove(request)
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.block_copies.extend(copies)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        self._sort_running()

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        end = request.num_computed_tokens + num_new
        samples = 0
        if end == request.num_tokens:
            samples = 1 if request.forked else request.params.n
        return ScheduledChunk(request, request.num_computed_tokens, num_new, samples)

    # -- results ----------------------------------------------------------------------------

    def update(self, plan: SchedulerPlan, output: StepOutput) -> list[Request]:
        """Advance each scheduled request by what ran and append what was sampled; fork n > 1
        samples; retire requests that hit a token-level stop. Returns the forked siblings."""
        forked: list[Request] = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while its step ran
            request.num_computed_tokens = chunk.end
            tokens = output.tokens.get(request.request_id)
            if not tokens:
                continue
            logprobs = output.logprobs.get(request.request_id) or [None] * len(tokens)
            if not request.forked:
                forked += self._fork(request, tokens[1:], logprobs[1:])
            request.append_output(tokens[0], logprobs[0])
            self._check_stop(request)
        return forked

    def _fork(self, parent: Request, tokens: list[int], logprobs: list) -> list[Request]:
        parent.forked = True
        children = []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True), start=1):
            child = parent.fork(i, sample_id(parent.group_id, i))
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            child.append_output(token, logprob)
            children.append(child)
        self._sort_running()
        for child in children:
            self._check_stop(child)
        return children

    def _check_stop(self, request: Request) -> None:
        token = request.output_token_ids[-1]
        params = request.params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(request, FinishReason.STOP)
                return
            if token in params.stop_token_ids:
                self.finish(request, FinishReason.STOP, stop_reason=token)
                return
        if num_out >= request.max_output_tokens or request.num_tokens >= self.max_model_len:
            self.finish(request, FinishReason.LENGTH)
