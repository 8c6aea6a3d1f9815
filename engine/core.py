"""EngineCore: scheduler, block pool, runner, sampler and proposers; token ids in, token ids out.

proposals = proposer.propose(...)  # speculative decoding, when on: guesses for decoding requests
plan = scheduler.schedule()        # who runs, how many tokens, which blocks
out = runner.execute(plan)         # one forward pass + sampling
scheduler.update(plan, out)        # advance, fork n > 1, token-level stops
CoreOutputs                        # new token ids per sample (text is the output processor's)

It knows no text: detokenizing, stop strings and RequestOutputs belong to the output processor,
which tells the core where a stop string ended a sample (`stop_sample`). The offline LLMEngine
holds a core and runs both in one process; `kvharbor serve` runs the core in a process of its own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvharbor.common.block_hash import BlockHash, namespace_hash
from kvharbor.common.field_error import FieldError
from kvharbor.common.load_report import LoadReport
from kvharbor.engine.config import EngineConfig
from kvharbor.engine.core_io import (
    ENGINE_FAULT,
    REQUEST_FAULT,
    CoreOutput,
    CoreStats,
    EngineRequest,
    Failure,
    SampleDelta,
    fault_message,
)
from kvharbor.engine.core_parts import CoreParts, Progress
from kvharbor.engine.engine_stats import EngineStats
from kvharbor.engine.kv.kv_save import PushPolicy
from kvharbor.engine.lora.adapter import AdapterError, LoRAAdapter
from kvharbor.engine.lora.lora_manager import AdapterBusy, UnknownAdapter
from kvharbor.engine.model.loader import LoadedModel
from kvharbor.engine.request import FinishReason, Request
from kvharbor.engine.sampling_params import SamplingParams
from kvharbor.engine.scheduler import SchedulerPlan, StepOutput
from kvharbor.engine.spec.proposers import Proposal

if TYPE_CHECKING:  # the parts' types
    import torch

    from kvharbor.common.tokenizer import Tokenizer
    from kvharbor.engine.counter_board import CounterBoard
    from kvharbor.engine.cpu.cpu_kernels import CpuKernels
    from kvharbor.engine.kv.block_pool import BlockPool
    from kvharbor.engine.kv.capacity import KVCapacity
    from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
    from kvharbor.engine.kv.kv_handoff import HandoffLeases
    from kvharbor.engine.kv.kv_save import KVSaveQueue
    from kvharbor.engine.kv.kv_transfer import KVBlockIO
    from kvharbor.engine.lora.lora_manager import LoRAManager
    from kvharbor.engine.model.arch import ModelArch
    from kvharbor.engine.model.decoder import LlamaModel
    from kvharbor.engine.pooling import Pooling
    from kvharbor.engine.runner import ModelRunner
    from kvharbor.engine.sampler import Sampler
    from kvharbor.engine.scheduler import Scheduler
    from kvharbor.engine.spec.proposers import AdaptiveK, Proposer
    from kvharbor.engine.structured.guides import GuideFactory

log = logging.getLogger("kvharbor.engine")


@dataclass
class _Group:
    """One user request: n samples that share a prompt."""

    request_id: str
    params: SamplingParams
    samples: dict[int, Request] = field(default_factory=dict)
    reported: dict[int, int] = field(default_factory=dict)  # tokens already in a delta
    reported_finish: set[int] = field(default_factory=set)  # samples whose end was reported
    error: Failure | None = None
    hand_off: str | None = None  # a prefill for a decode engine: pin its prompt's KV under this key when it ends

    @property
    def finished(self) -> bool:
        # A request aborted or failed before its first token never forks its other samples.
        all_there = len(self.samples) == self.params.n or not self.samples[0].forked
        return all_there and all(r.is_finished for r in self.samples.values())


class EngineCore:
    """Requests and the step, over its parts: built in start-up order by engine/core_parts.py, and
    declared here, each a field the core process, the KV publisher, the metrics and the tests read."""

    config: EngineConfig
    board: CounterBoard  # the counters its parts and its process keep (KV events, the shared store, grammars)
    device: torch.device
    dtype: torch.dtype
    model_name: str
    arch: ModelArch
    tokenizer: Tokenizer | None
    pooling: Pooling | None  # an embedding engine's (engine/pooling.py); None: it generates
    model: LlamaModel
    attention_backend: str
    batch_invariant: bool
    weight_bytes: int
    draft_model: LlamaModel | None
    loras: LoRAManager | None
    capacity: KVCapacity
    max_model_len: int
    pool: BlockPool
    kv: KVCacheManager
    eos_token_ids: frozenset[int]
    scheduler: Scheduler
    sampler: Sampler
    cpu_kernels: CpuKernels | None  # decode attention's CPU kernels, where they run
    runner: ModelRunner
    kv_io: KVBlockIO
    kv_saves: KVSaveQueue | None  # blocks copied out for the shared store; None: it pushes nothing
    handoffs: HandoffLeases
    guides: GuideFactory
    proposer: Proposer | None
    adaptive_k: AdaptiveK | None

    def __init__(
        self, config: EngineConfig, progress: Progress | None = None, loaded_model: LoadedModel | None = None,
        kv_save: PushPolicy | None = None,
    ) -> None:
        """Build the parts (engine/core_parts.py: load or adopt `loaded_model`, whose tensors are
        copied, not changed; size the KV pool), then warm up. `progress` receives one line per
        start-up phase. `kv_save`: which blocks to copy out for the shared store (kv/kv_save.py;
        None or "off": none), for a host that writes them there (kv/kv_offload.py)."""
        say = progress or (lambda msg: log.info(msg))
        t0 = time.monotonic()
        self._take(CoreParts(config, say, loaded_model, kv_save))
        self.kv_transfer_port = 0  # set by the core process once its hand-off server listens
        self.stats = EngineStats()
        self._groups: dict[str, _Group] = {}
        self._touched: set[str] = set()
        self._told_no_spec = False
        say("warming up ...")
        self._warm_up()
        say(f"ready in {time.monotonic() - t0:.1f}s")

    def _take(self, parts: CoreParts) -> None:
        """Each part, by name, into the field declared for it."""
        self.config = parts.config
        self.board = parts.board
        self.device = parts.device
        self.dtype = parts.dtype
        self.model_name = parts.model_name
        self.arch = parts.arch
        self.tokenizer = parts.tokenizer
        self.pooling = parts.pooling
        self.model = parts.model
        self.attention_backend = parts.attention_backend
        self.batch_invariant = parts.batch_invariant
        self.weight_bytes = parts.weight_bytes
        self.draft_model = parts.draft_model
        self.loras = parts.loras
        self.capacity = parts.capacity
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.kv = parts.kv
        self.eos_token_ids = parts.eos_token_ids
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.cpu_kernels = parts.cpu_kernels
        self.runner = parts.runner
        self.kv_io = parts.kv_io
        self.kv_saves = parts.kv_saves
        self.handoffs = parts.handoffs
        self.guides = parts.guides
        self.proposer = parts.proposer
        self.adaptive_k = parts.adaptive_k

    def _propose(self) -> dict[str, Proposal]:
        """Guesses for the running requests that decode this step and have not opted out."""
        if self.proposer is None:
            return {}
        try:
            return self._proposals()
        except Exception:  # guesses are optional: a failed proposer costs speed, never a request
            log.exception("the speculative proposer failed; this step runs without guesses")
            return {}

    def _proposals(self) -> dict[str, Proposal]:
        decoding = [
            r for r in self.scheduler.running
            if r.forked and r.params.speculative and r.guide is None and r.num_tokens - r.num_computed_tokens == 1
        ]  # fmt: skip
        ks = {r.request_id: self.adaptive_k.k_for(r) for r in decoding}
        return self.proposer.propose([r for r in decoding if ks[r.request_id]], ks)

    def _check_task(self, params: SamplingParams) -> None:
        """An embedding engine pools, a generating one samples: a request for the other is refused."""
        if self.pooling is not None and params.pooling is None:
            raise FieldError("model", f"this engine serves embeddings (task embed) of {self.model_name!r}: ask "
                             "/v1/embeddings, or start an engine with --task generate for chat and completions")
        if self.pooling is None and params.pooling is not None:
            raise FieldError("model", f"this engine generates with {self.model_name!r} (task generate): start one "
                             "with --task embed (or an embedding model) for /v1/embeddings")

    def _warm_up(self) -> None:
        # One short request through the whole path, so the first user does not pay for lazy
        # initialization (oneDNN kernels, allocator). Its blocks are dropped from the cache.
        warm = "warmup-" + os.urandom(4).hex()
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        if self.pooling is not None:
            params = SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooling.mode)
        self.add_request(EngineRequest(warm, [0] * min(8, self.max_model_len - 2), params))
        while self.has_unfinished():
            self.step()
        self.pool.reset_prefix_cache()
        self.pool.take_events()
        self.stats = EngineStats()

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for bad input; UnknownAdapter
        (a ValueError) when `req.lora` names no adapter this engine serves.

        P/D (engine/README.md): `req.hand_off` makes it a prefill for a decode engine (n=1): when
        it ends, its prompt's full KV blocks stay pinned under a lease of that key (self.handoffs;
        the API server draws one per prefill: engine/kv/handoff_handles.py). `req.first_token`
        continues a prefill done elsewhere: that token is the first output, and only what the
        prefix cache lacks (the prompt's tail, once its blocks were imported) runs."""
        # NOTE: the request was validated where it was built (common/openai_api.py and
        # SamplingParams at the HTTP edge, LLMEngine.add_request offline); what is checked here
        # needs the core: its vocabulary, context, --max-n, the ids and leases in flight.
        params, request_id, hand_off, first_token = req.params, req.request_id, req.hand_off, req.first_token
        if request_id in self._groups:
            raise FieldError("request_id", f"request id {request_id!r} is already in use")
        ids = self._check_prompt(req.prompt_token_ids)
        self._check_task(params)
        if params.n > self.config.limits.max_n:
            raise FieldError("n", f"n={params.n} exceeds the engine's limit of {self.config.limits.max_n} (--max-n)")
        params.check_vocab(self.arch.vocab_size)
        self._check_handoff(params, hand_off, first_token)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise FieldError(
                "prompt", f"the prompt has {len(ids)} tokens but this model's context is {self.max_model_len}: "
                "shorten the prompt (at least one token must be generated)",
            )
        if params.min_tokens > min(room, params.max_tokens or room):
            raise FieldError(
                "min_tokens",
                f"min_tokens={params.min_tokens} plus the {len(ids)}-token prompt exceeds the model's context "
                f"of {self.max_model_len} tokens: ask for at most {room}"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise FieldError(
                "max_tokens",
                f"max_tokens={params.max_tokens} plus the {len(ids)}-token prompt exceeds the model's context "
                f"of {self.max_model_len} tokens: ask for at most {room}"
            )
        guide = req.guide
        if params.structured is not None and guide is None:  # offline: compiled here
            guide = self.guides.guide(params.structured)
        if guide is not None and params.continued_tokens:
            self._walk(guide, ids, params.continued_tokens)
        if guide is not None and self.proposer is not None and not self._told_no_spec:
            self._told_no_spec = True  # once per engine: every guided request is alike
            log.info("speculative decoding skips structured-output requests: a proposal would have to be "
                     "checked against the grammar token by token, which this engine does not do")  # fmt: skip
        request = Request(
            request_id,
            ids,
            params,
            params.max_tokens or room,
            namespace_hash(self.model_name, req.cache_salt, self.adapter_identity(req.lora)),
            priority=req.priority,
            tenant=req.tenant,
            arrival_time=req.arrival_time,
            lora=req.lora,
        )
        request.guide = guide
        self.scheduler.add(request)
        group = _Group(request_id, params, hand_off=hand_off)
        self._groups[request_id] = group
        self._register(group, request)
        if first_token is not None:
            request.append_output(first_token)
            self.scheduler.check_stop(request)  # the prefill's token may already end it
            self._touched.add(request_id)

    @staticmethod
    def _walk(guide, ids: list[int], count: int) -> None:
        """A migrated stream's grammar, walked over its output so far (the prompt's last `count`
        tokens), so the next token continues the structure where the last engine left it."""
        if count > len(ids):
            raise FieldError("continued_tokens", f"continued_tokens={count} exceeds the prompt's {len(ids)} tokens")
        for token in ids[len(ids) - count :]:
            guide.advance(token)
        if guide.error is not None:
            raise ValueError(f"the continued output does not follow its structured-output spec: {guide.error}")

    def adapter_identity(self, lora: str | None) -> str | None:
        """The KV identity of adapter `lora` (None: the base model); raises UnknownAdapter."""
        if lora is None:
            return None
        if self.loras is None:
            raise UnknownAdapter(f"adapter {lora!r} asked for, but this engine serves no LoRA adapters (--lora)")
        return self.loras.get(lora).identity

    # -- adapters (between steps) -------------------------------------------------------------

    def load_lora(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` (lora.load_adapter, read off the engine thread); raises AdapterError."""
        if self.loras is None:
            raise AdapterError("this engine serves no LoRA adapters: start it with --enable-lora or --lora")
        self.loras.add(adapter)
        log.info("LoRA adapter loaded", extra={"adapter": adapter.name, "rank": adapter.rank, "path": adapter.path})

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`. Raises UnknownAdapter, or AdapterError while requests use it."""
        if self.loras is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded: this engine serves no LoRA adapters")
        users = sum(1 for r in self.scheduler.requests.values() if r.lora == name)
        if users:
            raise AdapterBusy(f"adapter {name!r} has {users} requests in flight: retry when they are done")
        self.loras.remove(name)
        log.info("LoRA adapter unloaded", extra={"adapter": name})

    def _check_handoff(self, params: SamplingParams, hand_off: str | None, first_token: int | None) -> None:
        if hand_off is not None and not (isinstance(hand_off, str) and hand_off):
            raise ValueError(f"a hand-off names its lease with a non-empty string, not {hand_off!r}")
        held = hand_off and self.handoffs.size(hand_off) is not None
        if held or (hand_off and any(g.hand_off == hand_off for g in self._groups.values())):
            raise ValueError(f"the hand-off lease {hand_off!r} is already held: each prefill needs a key of its own")
        if (hand_off or first_token is not None) and params.n != 1:
            raise ValueError(f"a disaggregated request samples one sequence, not n={params.n}")
        if hand_off and first_token is not None:
            raise ValueError("a request is either a hand-off prefill or its continuation, not both")
        if first_token is not None and params.logprobs is not None:
            # NOTE: the first token's logprob was computed on the prefill engine; without it every
            # logprob reported here would sit one token off (they did, before this check).
            raise ValueError(
                "a hand-off continuation (first_token_id) reports no logprobs: send logprobs requests whole"
            )
        if first_token is not None and not (isinstance(first_token, int) and 0 <= first_token < self.arch.vocab_size):
            raise ValueError(f"first_token_id {first_token!r} is outside the vocabulary [0, {self.arch.vocab_size})")

    def _check_prompt(self, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            raise ValueError("a request needs a prompt or prompt_token_ids")
        ids = list(prompt_token_ids)
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size), None)
        if bad is not None:
            raise FieldError("prompt", f"token id {bad!r} is outside the vocabulary [0, {self.arch.vocab_size})")
        if not ids:
            raise FieldError("prompt", "the prompt is empty: send at least one token")
        return ids

    def _register(self, group: _Group, request: Request) -> None:
        group.samples[request.index] = request
        group.reported[request.index] = 0

    def abort(self, request_ids: str | list[str]) -> None:
        """Cancel requests (all their samples); their blocks go back to the pool at once. Unknown
        or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for request in group.samples.values():
                self.scheduler.finish(request, FinishReason.ABORT)
            self._touched.add(rid)

    def stop_sample(self, request_id: str, index: int, num_output_tokens: int, stop_string: str) -> None:
        """A stop string ended sample `index` of `request_id` after `num_output_tokens` outputs:
        retire it there (its blocks go back at once). Unknown or finished samples are ignored."""
        group = self._groups.get(request_id)
        request = group.samples.get(index) if group is not None else None
        if request is None:
            return
        self.scheduler.stop_at(request, num_output_tokens, stop_string)
        group.reported[index] = min(group.reported[index], num_output_tokens)
        self._touched.add(request_id)

    def has_unfinished(self) -> bool:
        # Pending imports count: their blocks are held until a step writes them.
        return self.scheduler.num_unfinished > 0 or bool(self._touched) or self.kv.has_loads

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Run one iteration. Returns an output for every request that progressed or finished."""
        self.handoffs.expire()
        plan = self.scheduler.schedule(self._propose())
        if plan.is_empty and self.scheduler.num_unfinished and not self.scheduler.running:
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_unfinished} requests waiting")
        if not plan.is_empty or plan.moves_kv:
            self._run(plan)
        self._hold_handoffs()
        outputs = [self._output(self._groups[g]) for g in sorted(self._touched) if g in self._groups]
        for rid in list(self._touched):
            group = self._groups.get(rid)
            if group is not None and group.finished:
                for request in group.samples.values():
                    self.sampler.forget(request)
                    if self.proposer is not None:
                        self.proposer.release(request)
                        self.adaptive_k.forget(request)
                del self._groups[rid]
        self._touched.clear()
        return outputs

    def _hold_handoffs(self) -> None:
        # In the step that finished them, before any later step could evict their blocks.
        for rid in self._touched:
            group = self._groups.get(rid)
            if group is None or not group.hand_off or not group.finished:
                continue
            lease, group.hand_off = group.hand_off, None
            request = group.samples[0]
            if group.error is None and request.finish_reason is not FinishReason.ABORT:
                full = request.num_prompt_tokens // self.capacity.block_size
                self.handoffs.hold(lease, request.full_block_hashes(self.capacity.block_size)[:full])

    def _run(self, plan: SchedulerPlan) -> None:
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(plan)
        except Exception as exc:
            self.kv.loaded(ok=False)
            self._fail(plan, exc)
            return
        self.kv.loaded()
        if plan.is_empty:
            return  # it only moved KV
        self.stats.record(plan, time.perf_counter() - t0)
        self._record_speculation(plan, out)
        forked = self.scheduler.update(plan, out)
        for child in forked:
            self._register(self._groups[child.group_id], child)
        for request in [c.request for c in plan.chunks] + forked:
            self._touched.add(request.group_id)
        by_id = {c.request.request_id: c for c in plan.chunks}
        for rid, message in out.faults.items():  # failed by its own options: it ends alone
            chunk = by_id[rid]
            log.warning("a request failed on its own; the rest of its step goes on",
                        extra={"request_id": chunk.request.group_id, "error": message})  # fmt: skip
            self.kv.uncache_blocks([chunk.request], chunk.start)  # its forward may have failed half-way
            self._end_group(self._groups[chunk.request.group_id], Failure(message, REQUEST_FAULT))

    def _record_speculation(self, plan: SchedulerPlan, out: StepOutput) -> None:
        for chunk in plan.chunks:
            if chunk.draft:
                accepted = len(out.tokens.get(chunk.request.request_id, [None])) - 1
                self.stats.spec_verifications += 1
                self.stats.spec_proposed += len(chunk.draft)
                self.stats.spec_accepted += accepted
                self.adaptive_k.record(chunk.request, len(chunk.draft), accepted)

    def _fail(self, plan: SchedulerPlan, exc: Exception) -> None:
        log.exception("engine step failed; failing its %d requests", len(plan.chunks))
        for chunk in plan.chunks:  # half-written KV: nobody may hit it
            self.kv.uncache_blocks([chunk.request], chunk.start)
        failure = Failure(fault_message(exc), ENGINE_FAULT)
        for group_id in {c.request.group_id for c in plan.chunks}:
            self._end_group(self._groups[group_id], failure)

    def _end_group(self, group: _Group, failure: Failure) -> None:
        """End a user request whole with `failure`: its samples that were not in the step too."""
        if group.error is not None:
            return
        group.error = failure
        # Siblings a failed fork made before it raised are the scheduler's but not yet the group's.
        for request in [r for r in self.scheduler.requests.values() if r.group_id == group.request_id]:
            if group.samples.get(request.index) is not request:
                self._register(group, request)
        for request in group.samples.values():
            self.scheduler.finish(request, FinishReason.ERROR)
        self._touched.add(group.request_id)

    def _output(self, group: _Group) -> CoreOutput:
        """The group's samples that moved since their last report: new tokens only."""
        samples = []
        for index, request in sorted(group.samples.items()):
            done = group.reported[index]
            new = request.output_token_ids[done:]
            reason = request.finish_reason.value if request.finish_reason else None
            if not new and ((done and reason is None) or index in group.reported_finish):
                continue  # a sibling that did not move this step, or whose end was already told
            group.reported[index] = len(request.output_token_ids)
            if reason is not None:
                group.reported_finish.add(index)
            stop = request.stop_reason if isinstance(request.stop_reason, int) else None
            logprobs = request.logprobs[done:] if group.params.logprobs is not None else []
            samples.append(SampleDelta(index, new, logprobs, reason, stop))
        first = group.samples[0]
        embedding = first.embedding.tolist() if first.embedding is not None and group.finished else None
        return CoreOutput(group.request_id, samples, group.finished, max(0, first.num_cached_tokens), group.error,
                          embedding)  # fmt: skip

    def import_prefix(
        self, hashes: Sequence[BlockHash], payloads: Sequence[bytes], prefix: Sequence[BlockHash] = ()
    ) -> int:
        """Put KV blocks pulled from elsewhere into the prefix cache, as if computed here
        (KVCacheManager.import_blocks: `hashes` continues the chain `prefix`, `payloads[i]` is
        block i's KV in `kv_io.format`). The next step's runner writes them before its forward,
        so a request added after this call hits them. Returns how many blocks were imported."""
        return self.kv.import_blocks(hashes, payloads, prefix, self.kv_io.format.block_bytes)

    # -- introspection ------------------------------------------------------------------------

    def load(self) -> LoadReport:
        """The engine's part of the load report (common/load_report.py); the server adds its own fields."""
        waiting, running = self.scheduler.waiting, self.scheduler.running
        # Prompt tokens not computed yet, queued or mid-prefill: what a new request waits behind.
        prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*waiting, *running))
        stats = self.stats
        return LoadReport(
            model=self.model_name,
            running=len(running),
            waiting=len(waiting),
            waiting_prefill_tokens=prefill,
            steps=stats.steps,
            context_tokens=sum(r.num_tokens for r in running),
            kv_blocks_total=self.kv.num_usable_blocks,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            prefill_tokens_per_s=round(stats.prefill_tokens_per_s, 1),
            **stats.decode_report(),
            spec_acceptance_rate=round(stats.spec_accepted / stats.spec_proposed, 4) if stats.spec_proposed else None,
            weight_bytes=self.weight_bytes,
            kv_bytes_per_token=self.capacity.bytes_per_token,
            kv_format=self.kv_io.format.tag,
            block_size=self.capacity.block_size,
            role=self.config.disagg.role,
            task="generate" if self.pooling is None else "embed",
            kv_pinned_blocks=self.handoffs.num_blocks,
            kv_transfer_port=self.kv_transfer_port,
            kv_transfer_bytes_per_s=round(stats.kv_transfer_bytes_per_s, 1),
            kv_transfer_age_s=stats.kv_transfer_age_s(),
            **self._lora_report(),
        )

    def counters(self, aborted: int = 0) -> CoreStats:
        """The core's counters, read in one place from the parts that own them: the KV manager's
        prefix lookups, the step's speculation and time, the LoRA slots' swaps, the sampler's
        masking. `aborted` is counted by whoever aborts (the engine loop). The board (`self.board`)
        is read apart, when the counters cross the link (serve/core_process.py): the core
        process's tasks count into it between steps."""
        kv, stats, loras = self.kv, self.stats, self.loras
        return CoreStats(
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits, aborted=aborted,
            spec_verifications=stats.spec_verifications, spec_proposed=stats.spec_proposed,
            spec_accepted=stats.spec_accepted, lora_swaps=loras.swaps if loras is not None else 0,
            lora_swap_seconds=loras.swap_seconds if loras is not None else 0.0, step_seconds=stats.step_seconds,
            mask_seconds=self.sampler.mask_seconds,
        )  # fmt: skip

    def _lora_report(self) -> dict:
        if self.loras is None:
            return {}
        adapters = {name: a.identity for name, a in self.loras.adapters.items()}
        return {"lora_adapters": adapters, "lora_active": self.loras.active, "lora_slots": self.loras.slots.num_slots,
                "lora_bytes": self.loras.nbytes}  # fmt: skip

    def check_integrity(self) -> None:
        self.kv.check_integrity()
