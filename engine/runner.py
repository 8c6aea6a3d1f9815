"""ModelRunner: turns a SchedulerPlan into one forward pass over a flat batch, then samples."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvharbor.engine.core_io import fault_message
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv.kv_quant import SCALE_BYTES
from kvharbor.engine.kv.kv_save import KVSaveQueue
from kvharbor.engine.kv.kv_transfer import KVBlockIO
from kvharbor.engine.model.attention import build_metadata
from kvharbor.engine.model.decoder import LlamaModel
from kvharbor.engine.sampler import Sampler, SampleRow
from kvharbor.engine.scheduler import ScheduledChunk, SchedulerPlan, StepOutput

if TYPE_CHECKING:
    from kvharbor.engine.lora.lora_manager import LoRAManager

log = logging.getLogger("kvharbor.engine.runner")


class ModelRunner:
    """Owns the model and its KV tensor `[layers, 2 (K/V), kv_heads, num_blocks * block_size, dim]`.

    KV moves of a plan run here, around the forward: `kv_io` (engine/kv/kv_transfer.py, over this
    runner's cache: built here when `kv_identity` names the weights) writes loads, and `saves`
    (engine/kv/kv_save.py, built here when `save_blocks`) takes the blocks to copy out for the
    shared store.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCacheManager,
        sampler: Sampler | None,  # None: a runner whose caller samples (the draft model)
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "torch",
        cpu_kernels: Any = None,  # cpu_kernels.CpuKernels: decode attention through its kernel
        kv_dtype: str = "auto",  # int8 / fp8: the cache holds 8-bit rows (engine/kv/kv_quant.py)
        invariant: bool = False,  # batch-invariant attention: every row through cpu_kernels (engine/model/attention.py)
        lora: LoRAManager | None = None,  # the requests' adapters
        kv_identity: tuple[str, str] | None = None,  # (model name, weights fingerprint): its blocks' KV I/O
        save_blocks: bool = False,  # queue the plans' saves for the shared store (needs kv_identity)
        counters: CounterBoard | None = None,  # what the save queue counts into (the core's board)
    ) -> None:
        arch = model.arch
        self.attention_backend = attention_backend
        self.cpu_kernels = cpu_kernels
        self.kv_shape = (arch.num_kv_heads, arch.head_dim)
        self.windows = arch.windows  # its layers' sliding windows, for each step's metadata
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.device = device
        self.block_size = kv.block_size
        slots = kv.pool.num_blocks * self.block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.invariant = invariant
        quantized = kv_dtype != "auto"
        row = arch.head_dim + SCALE_BYTES if quantized else arch.head_dim
        # NOTE: zeros, not empty: padded decode slots are masked, but 0 x NaN garbage would be NaN.
        self.kv_caches = torch.zeros(
            arch.num_layers, 2, arch.num_kv_heads, slots, row, dtype=torch.uint8 if quantized else dtype, device=device
        )
        self.kv_io: KVBlockIO | None = None  # blocks as bytes, in and out of kv_caches (the shared store, P/D)
        if kv_identity is not None:
            name, fingerprint = kv_identity
            self.kv_io = KVBlockIO(self.kv_caches, self.block_size, name, fingerprint, kv_dtype, arch.head_dim)
        self.saves: KVSaveQueue | None = None
        if save_blocks:
            self.saves = KVSaveQueue(self.kv_io, counters or CounterBoard())
        self.lora = lora

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        # Copy-on-write: a sibling's shared partial block is duplicated before anyone appends.
        bs = self.block_size
        for src, dst in copies:
            self.kv_caches[..., dst * bs : (dst + 1) * bs, :] = self.kv_caches[..., src * bs : (src + 1) * bs, :]

    @torch.inference_mode()
    def execute(self, plan: SchedulerPlan) -> StepOutput:
        """Run every chunk of `plan` through the model and sample where a chunk completes its
        request's known tokens. Writes K/V into the cache; touches no scheduler state. A plan
        without chunks only moves KV."""
        self._move_kv_in(plan)
        self._copy_blocks(plan.block_copies)
        out = StepOutput()
        if plan.chunks:
            out = self._run_chunks(plan.chunks)
        saves = plan.saves_after
        if out.faults and saves:  # a failed request's blocks hold no KV to share
            bad = {b for c in plan.chunks if c.request.request_id in out.faults for b in self.kv.block_ids(c.request)}
            saves = [s for s in saves if s[0] not in bad]
        if saves and self.saves is not None:
            self.saves.save(saves)
        return out

    def _run_chunks(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """The forward and the sampling of `chunks`. When the batch fails, each chunk runs again
        alone: one that fails alone is its request's fault (StepOutput.faults), the others'
        tokens stand. Raises when every chunk fails alone too (the engine's fault)."""
        try:
            return self._sample(*self._forward(chunks))
        except Exception:
            if len(chunks) == 1:
                raise
            log.exception("a step of %d chunks failed; running each alone to find the cause", len(chunks))
        # NOTE: re-running a chunk rewrites the same KV slots from the same tokens, and nothing was
        # drawn (Sampler.sample keeps each row's failure its own): in batch-invariant mode each
        # survivor's tokens are the bits it would have had without the failed request.
        out, failure = StepOutput(), None
        for chunk in chunks:
            try:
                alone = self._sample(*self._forward([chunk]))
            except Exception as exc:
                failure = exc
                out.faults[chunk.request.request_id] = fault_message(exc)
                continue
            out.tokens.update(alone.tokens)
            out.logprobs.update(alone.logprobs)
            out.faults.update(alone.faults)
        if len(out.faults) == len(chunks) and failure is not None:
            raise failure
        return out

    def _move_kv_in(self, plan: SchedulerPlan) -> None:
        """Copy out what the forward may overwrite, then write the imported blocks."""
        if plan.saves_before and self.saves is not None:
            self.saves.save(plan.saves_before)
        if plan.loads:
            self.kv_io.load([load.block_id for load in plan.loads], [load.payload for load in plan.loads])

    @torch.inference_mode()
    def all_logits(self, chunk: ScheduledChunk) -> torch.Tensor:
        """float32 logits after every token of one chunk (teacher forcing: benchmarks/quality.py)."""
        _, hidden = self._forward([chunk])
        return self.model.logits(hidden).cpu()

    @torch.inference_mode()
    def last_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """float32 logits after each chunk's last token, in the order given (the draft model's
        steps, which sample on their own)."""
        ordered, hidden = self._forward(chunks)
        ends = dict(zip(map(id, ordered), itertools.accumulate(c.num_tokens for c in ordered), strict=True))
        rows = torch.tensor([ends[id(c)] - 1 for c in chunks], device=self.device)
        return self.model.logits(hidden[rows]).cpu()

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """One forward pass over the chunks; returns them in the order they ran, and the hidden states."""
        # Decodes (one new token) go first, shortest context first: attention batches them in
        # groups of similar length. Longer chunks follow grouped by adapter: one LoRA segment each.
        chunks = sorted(chunks, key=_batch_order)
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
        input_ids, positions = self._inputs(chunks)
        meta = build_metadata(
            [self.kv.block_ids(c.request) for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            num_decodes,
            self.block_size,
            self.dtype,
            self.device,
            self.attention_backend,
            self.kv_shape,
            self.cpu_kernels,
            self.kv_dtype,
            self.invariant,
            self.windows,
        )
        lora = None
        if self.lora is not None:
            lora = self.lora.step([(c.num_tokens, c.request.lora) for c in chunks], num_decodes)
        return chunks, self.model(input_ids, positions, self.kv_caches, meta, lora)

    def _sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> StepOutput:
        rows, last, spec, pooled = [], [], [], []
        offset = 0
        for chunk in chunks:
            offset += chunk.num_tokens
            if chunk.request.params.pooling is not None:
                pooled.append((chunk, offset - chunk.num_tokens, offset))
            elif chunk.draft:  # the target's prediction after the last token and after each draft token
                spec.append((chunk, len(last)))
                last.extend(range(offset - 1 - len(chunk.draft), offset))
            elif chunk.num_samples:
                rows.append(SampleRow(len(last), chunk.request, chunk.num_samples))
                last.append(offset - 1)
        out = StepOutput()
        if last:
            logits = self.model.logits(hidden[torch.tensor(last, device=self.device)]).cpu()
            if rows:
                sampled = self.sampler.sample(logits, rows)
                out.tokens, out.logprobs, out.faults = sampled.tokens, sampled.logprobs, sampled.faults
            for chunk, first in spec:
                rid = chunk.request.request_id
                scored = logits[first : first + len(chunk.draft) + 1]
                try:
                    tokens, logprobs = self.sampler.verify(scored, chunk.request, chunk.draft, chunk.draft_probs)
                except Exception as exc:  # its own options failed it, as in Sampler.sample
                    out.faults[rid] = fault_message(exc)
                    continue
                out.tokens[rid] = tokens
                if logprobs is not None:
                    out.logprobs[rid] = logprobs
        for chunk, start, end in pooled:
            self._pool(chunk, hidden[start:end], out)
        return out

    def _pool(self, chunk: ScheduledChunk, hidden: torch.Tensor, out: StepOutput) -> None:
        """A pooling request's chunk (engine/pooling.py): the mean's partial sum of its rows, kept
        by the chunk's start (a chunk run again after a failed batch replaces its own part); once
        the prompt is done, its vector and a placeholder token that ends it (max_tokens 1)."""
        request = chunk.request
        if request.params.pooling == "mean":
            if chunk.start == 0 or request.pool_sum is None:
                request.pool_sum = {}
            request.pool_sum[chunk.start] = self.model.final_hidden(hidden).sum(0)
        if not chunk.num_samples:
            return
        if request.params.pooling == "mean":
            vector = torch.stack(list(request.pool_sum.values())).sum(0) / chunk.end
            request.pool_sum = None
        else:
            vector = self.model.final_hidden(hidden[-1:])[0]
        out.embeddings[request.request_id] = vector.cpu()
        out.tokens[request.request_id] = [0]

    def _inputs(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        for c in chunks:
            ids.extend(c.input_ids)
            pos.extend(range(c.start, c.end))
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device),
        )


def _batch_order(chunk: ScheduledChunk) -> tuple:
    decode = chunk.num_tokens == 1
    return (not decode, chunk.start if decode else chunk.request.lora or "")
