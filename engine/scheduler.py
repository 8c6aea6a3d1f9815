"""Iteration-level scheduler: one token budget per step, no prefill or decode phases.

Each request's `num_computed_tokens` chases its `num_tokens`. A step gives every running request
what it still needs (1 token when decoding, a chunk when prefilling), then admits waiting requests,
longest cached prefix first skipped, while the budget, the sequence limit and the pool allow.

Control flow, driven by EngineCore.step (engine/core.py):
    plan = scheduler.schedule();  output = runner.execute(plan);  scheduler.update(plan, output)
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvharbor.engine.config import SchedulerConfig
from kvharbor.engine.core_io import fault_message
from kvharbor.engine.kv.block_pool import Save
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager, Load
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
    draft: list[int] = field(default_factory=list)  # speculated tokens, run after the request's last one
    draft_probs: Any = None  # their draft distributions [len(draft), vocab]; None: deterministic proposer

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def input_ids(self) -> list[int]:
        """The tokens this chunk runs: the request's own, then any draft."""
        own = self.request.all_token_ids[self.start : self.end - len(self.draft)]
        return own + self.draft if self.draft else own


@dataclass
class SchedulerPlan:
    """One step's work. The runner carries it out in this order: `saves_before` (copied out
    while intact), `loads` (imported KV written), `block_copies`, the forward over `chunks`,
    then `saves_after` (blocks the forward filled), so no KV moves inside scheduling."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run first
    preempted: list[Request] = field(default_factory=list)
    saves_before: list[Save] = field(default_factory=list)  # evicted or reused cached blocks
    loads: list[Load] = field(default_factory=list)  # imported blocks to write
    saves_after: list[Save] = field(default_factory=list)  # blocks cached by this step

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def moves_kv(self) -> bool:
        return bool(self.saves_before or self.loads or self.saves_after)


@dataclass
class StepOutput:
    """What the runner sampled: for each request id, the new tokens (n of them on a fork; for a
    speculative chunk, the accepted draft tokens and then the target's own)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    # Requests whose own options failed them this step (a message each): they get no tokens, and
    # the core ends them alone (engine/core.py), the rest of the step going on.
    faults: dict[str, str] = field(default_factory=dict)
    # Pooling requests whose prompt completed: their pooled hidden state (float32, final-normed).
    embeddings: dict[str, Any] = field(default_factory=dict)


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
        loras: Any = None,  # lora_manager.LoRAManager: slots for requests on adapters
    ) -> None:
        self.config = config
        self.kv = kv
        self.loras = loras
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
            self._release_adapter(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self.requests[request.request_id]

    def stop_at(self, request: Request, num_output_tokens: int, stop_reason: str) -> None:
        """Retire `request` after its first `num_output_tokens` outputs, where a stop string ended
        its text: the tokens after it (several when a speculated run was accepted) are forgotten,
        so it ends where one token at a time would have. A finished request is left alone."""
        if request.is_finished:
            return
        extra = len(request.output_token_ids) - num_output_tokens
        if extra > 0:
            del request.output_token_ids[num_output_tokens:]
            del request.all_token_ids[len(request.all_token_ids) - extra :]
            del request.logprobs[num_output_tokens:]
        self.finish(request, FinishReason.STOP, stop_reason=stop_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- scheduling -------------------------------------------------------------------------

    def _rank(self) -> Callable[[Request], tuple]:
        tenants = Counter(r.tenant for r in self.running)
        return lambda r: (-r.priority, tenants[r.tenant], r.arrival_time)

    def _sort_running(self) -> None:
        self.running.sort(key=lambda r: (-r.priority, r.arrival_time))

    def _release_adapter(self, request: Request) -> None:
        if request.lora is not None and self.loras is not None:
            self.loras.release(request.lora)

    def _adapter_blocked(self, request: Request) -> bool:
        """Whether `request`'s adapter can get no slot this step (every slot serves running requests)."""
        return request.lora is not None and self.loras is not None and not self.loras.can_run(request.lora)

    def _preempt(self, victim: Request, plan: SchedulerPlan) -> None:
        self.running.remove(victim)
        self._release_adapter(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        plan.preempted.append(victim)

    def schedule(self, proposals: dict[str, Any] | None = None) -> SchedulerPlan:
        """Choose this step's work. Mutates queues, tables and each request's status.
        `proposals`: speculated tokens (proposers.Proposal) for decoding requests, run with their
        last token when the budget and the pool allow."""
        plan = SchedulerPlan()
        budget = self.config.max_num_batched_tokens
        self._sort_running()
        self._preempt_for_priority(plan)
        num_preempted = len(plan.preempted)
        budget = self._schedule_running(plan, budget)
        if len(plan.preempted) == num_preempted:  # NOTE: a pool that just forced preemption admits nobody
            budget = self._schedule_waiting(plan, budget)
        self._add_speculation(plan, budget, proposals or {})
        plan.loads = self.kv.take_loads()
        plan.saves_before, plan.saves_after = self.kv.pool.take_saves()
        return plan

    def _preempt_for_priority(self, plan: SchedulerPlan) -> None:
        # A waiting request that outranks the lowest running one takes its place when the batch or
        # the pool is full, but only if it could then run this very step: otherwise the victim's
        # work would be thrown away for nothing.
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=self._rank())
        if self._adapter_blocked(best):
            return
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

    def _add_speculation(self, plan: SchedulerPlan, budget: int, proposals: dict[str, Any]) -> None:
        """Turn scheduled decodes into speculative chunks with what the step left over: guesses
        take no budget or blocks from real work, and never cause a preemption."""
        for i, chunk in enumerate(plan.chunks):
            proposal = proposals.get(chunk.request.request_id)
            if budget <= 0:
                return
            if proposal is None or chunk.num_tokens != 1 or chunk.request.status is not RequestStatus.RUNNING:
                continue
            spec = self._speculative_chunk(chunk.request, proposal, budget, plan)
            if spec is not None:
                plan.chunks[i] = spec
                budget -= len(spec.draft)

    def _speculative_chunk(
        self, request: Request, proposal: Any, budget: int, plan: SchedulerPlan
    ) -> ScheduledChunk | None:
        """The request's last token and as many guesses as the budget, its length limits and the
        free pool allow (its slot for the last token is already allocated)."""
        room = min(
            budget,
            request.max_output_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        draft = proposal.tokens[: max(0, room)]
        if not draft:
            return None
        copies = self.kv.allocate_slots(request, 1 + len(draft))
        if copies is None:
            return None
        plan.block_copies.extend(copies)
        probs = proposal.probs[: len(draft)] if proposal.probs is not None else None
        return ScheduledChunk(request, request.num_computed_tokens, 1 + len(draft), 1, draft, probs)

    def _schedule_waiting(self, plan: SchedulerPlan, budget: int) -> int:
        if not self.waiting:
            return budget
        order = _AdmissionOrder(self.waiting, self.running)
        taken: set[str] = set()
        draining: str | None = None  # the adapter whose slot drains for a request waiting for one
        while budget > 0 and len(self.running) < self.config.max_num_seqs and (request := order.head()) is not None:
            # NOTE: a request whose adapter gets no slot is passed over, not refused. The slot that
            # will free first takes no new request behind it, so it drains and the waiting request
            # gets it: a steady stream on the resident adapters cannot starve it, and the other
            # slots keep running theirs.
            if request.lora is not None and (request.lora == draining or self._adapter_blocked(request)):
                if draining is None:
                    draining = self.loras.first_to_free()
                order.skip(request)
                continue
            hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            copies = self.kv.allocate_slots(request, num_new, hit)
            if copies is None:
                break  # NOTE: head-of-line blocking keeps priority order strict
            order.take(request)
            if request.lora is not None and self.loras is not None:
                self.loras.acquire(request.lora)
            taken.add(request.request_id)
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.block_copies.extend(copies)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        if taken:
            self.waiting = [r for r in self.waiting if r.request_id not in taken]
        self._sort_running()
        return budget

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
            if request.is_finished or request.request_id in output.faults:
                continue  # aborted while its step ran, or failed by its own options (the core ends it)
            try:
                forked += self._advance(chunk, output)
            except Exception as exc:  # its grammar or a stop check: its own failure (DESIGN.md)
                output.faults[request.request_id] = fault_message(exc)
        return forked

    def _advance(self, chunk: ScheduledChunk, output: StepOutput) -> list[Request]:
        request = chunk.request
        tokens = output.tokens.get(request.request_id)
        if chunk.draft:
            self._accept(chunk, tokens or [], output.logprobs.get(request.request_id))
            return []
        request.num_computed_tokens = chunk.end
        if not tokens:
            return []
        if request.request_id in output.embeddings:
            request.embedding = output.embeddings[request.request_id]
        logprobs = output.logprobs.get(request.request_id) or [None] * len(tokens)
        forked = [] if request.forked else self._fork(request, tokens[1:], logprobs[1:])
        request.append_output(tokens[0], logprobs[0])
        self.check_stop(request)
        return forked

    def _accept(self, chunk: ScheduledChunk, tokens: list[int], logprobs: list | None = None) -> None:
        """A speculative chunk: KV is kept for the last token and the accepted draft tokens (as
        many as `tokens` minus the target's own), the rejected ones' slots are given back, and
        the tokens are appended one by one until a stop."""
        request = chunk.request
        request.num_computed_tokens = chunk.start + len(tokens)
        self.kv.truncate(request, request.num_computed_tokens)
        for i, token in enumerate(tokens):
            request.append_output(token, logprobs[i] if logprobs else None)
            self.check_stop(request)
            if request.is_finished:
                return

    def _fork(self, parent: Request, tokens: list[int], logprobs: list) -> list[Request]:
        parent.forked = True
        children = []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True), start=1):
            child = parent.fork(i, sample_id(parent.group_id, i))
            self.kv.fork(parent, child)
            self.requests[child.request_id] = child
            self.running.append(child)
            if child.lora is not None and self.loras is not None:
                self.loras.acquire(child.lora)  # the parent's slot: always there
            child.append_output(token, logprob)
            children.append(child)
        self._sort_running()
        for child in children:
            self.check_stop(child)
        return children

    def check_stop(self, request: Request) -> None:
        """Retire `request` if its last output token ends it (EOS, a stop token, a length limit)."""
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
        elif request.guide is not None and request.guide.complete and token in self.eos_token_ids:
            # A complete grammar allows only EOS (guides.py), which ignore_eos would run past.
            self.finish(request, FinishReason.STOP)


class _AdmissionOrder:
    """The waiting queue in the scheduler's order (`Scheduler._rank`): higher priority, then the
    tenant with fewer running requests, then the earlier arrival. A tenant's requests share its
    running count, so the next one is always some tenant's own best: each pick compares tenants,
    not requests. NOTE: a min over every waiting request per admission was quadratic; 5,000
    queued requests spent 29 s of a 61 s run in that min."""

    def __init__(self, waiting: list[Request], running: list[Request]) -> None:
        self.running = Counter(r.tenant for r in running)
        by_tenant: dict[str | None, list[Request]] = {}
        for request in waiting:
            by_tenant.setdefault(request.tenant, []).append(request)
        # Stable sorts: among equals, queue order, as min() over the queue had it.
        self.queues = {t: deque(sorted(q, key=lambda r: (-r.priority, r.arrival_time))) for t, q in by_tenant.items()}

    def head(self) -> Request | None:
        best: tuple | None = None
        for tenant, queue in self.queues.items():
            if queue:
                r = queue[0]
                key = (-r.priority, self.running[tenant], r.arrival_time)
                if best is None or key < best[0]:
                    best = (key, r)
        return None if best is None else best[1]

    def take(self, request: Request) -> None:
        self.queues[request.tenant].popleft()
        self.running[request.tenant] += 1

    def skip(self, request: Request) -> None:
        """Leave `request` waiting and look past it this step."""
        self.queues[request.tenant].popleft()

