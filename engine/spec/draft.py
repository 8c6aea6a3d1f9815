"""The draft-model proposer: a smaller model with the target's tokenizer and a paged KV cache of
its own, proposing k tokens per decoding request by running k batched steps of its own.

Its cache follows the target's tokens lazily: before proposing, each request's draft KV is cut
back to the longest prefix the draft computed that the request still has (accepted draft tokens
stay, rejected ones go), then the missing tokens run in one chunk whose last row gives the first
proposal. Draft tokens are drawn from q = the draft's distribution after every sampling option of
the request (the same processing the target's p gets), with a generator of the draft's own;
greedy requests take the draft's argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvharbor.common.block_hash import namespace_hash
from kvharbor.engine.kv.block_pool import BlockPool
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.model.decoder import LlamaModel
from kvharbor.engine.model.loader import load_model
from kvharbor.engine.request import Request
from kvharbor.engine.runner import ModelRunner
from kvharbor.engine.sampler import filtered_probs
from kvharbor.engine.scheduler import ScheduledChunk
from kvharbor.engine.spec.proposers import Proposal


def load_draft_model(
    path: str, target_arch: Any, dtype: torch.dtype, device: torch.device, cpu_threads: int | None
) -> LlamaModel:
    """The draft's weights, loaded before the target's KV pool is sized (so they are not counted
    as free memory); its vocabulary must be the target's. `cpu_threads`: give its linears the CPU
    fast path with this many threads (None: plain F.linear)."""
    loaded = load_model(path)
    if loaded.arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"draft model {path} has a vocabulary of {loaded.arch.vocab_size} tokens, the target "
            f"{target_arch.vocab_size}: the draft must share the target's tokenizer"
        )
    model = LlamaModel(loaded.arch, dtype, device)
    model.load_hf_state_dict({k: v.to(dtype) for k, v in loaded.state_dict.items()})
    if cpu_threads is not None:
        model.prepare_cpu_linears(cpu_threads)
    return model


def draft_kv_bytes_per_token(model: LlamaModel, dtype: torch.dtype) -> int:
    return model.arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


Adjust = Callable[[torch.Tensor, Request, list[int]], "torch.Tensor | None"]


@dataclass(frozen=True)
class DraftSetup:
    """What the draft proposer takes from the target engine, and nothing more."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_blocks: int  # the target's pool size (plan_capacity budgeted the draft's cache to match)
    attention_backend: str
    cpu_kernels: Any  # cpu_kernels.CpuKernels or None
    adjust: Adjust  # the target sampler's logit processing (bias, min_tokens, penalties)


class DraftModelProposer:
    def __init__(self, model: LlamaModel, setup: DraftSetup) -> None:
        self.device, self.dtype = setup.device, setup.dtype
        self.block_size = setup.block_size
        self._adjust = setup.adjust
        # As many token slots as the target's pool: the draft can shadow every running request.
        self.pool = BlockPool(setup.num_blocks, self.block_size, enable_caching=False)
        self.kv = KVCacheManager(self.pool)
        # The target's runner over the draft's model and cache: same batching, same attention backend.
        a = model.arch
        kernels = setup.cpu_kernels if setup.cpu_kernels and setup.cpu_kernels.takes_attention(
            a.num_heads, a.num_kv_heads, a.head_dim
        ) else None  # fmt: skip
        self.runner = ModelRunner(model, self.kv, None, self.dtype, self.device, setup.attention_backend, kernels)
        self.shadows: dict[str, Request] = {}
        self.generators: dict[str, torch.Generator] = {}

    # -- Proposer ------------------------------------------------------------------------------

    def propose(self, requests: list[Request], ks: dict[str, int]) -> dict[str, Proposal]:
        active = [r for r in requests if ks.get(r.request_id, 0) > 0]
        for request in active:
            self._sync(request)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in active}
        # Step 0 runs every missing token (the last one included); later steps one token each.
        feeds = {r.request_id: self._missing(r) for r in active}
        for step in range(max((ks[r.request_id] for r in active), default=0)):
            batch = [r for r in active if step < ks[r.request_id] and self._room(r, len(feeds[r.request_id]))]
            if not batch:
                break
            logits = self._forward(batch, feeds)
            for row, request in enumerate(batch):
                token, q = self._draw(logits[row], request, drafts[request.request_id])
                drafts[request.request_id].append(token)
                if q is not None:
                    probs[request.request_id].append(q)
                feeds[request.request_id] = [token]
            active = batch
        return {
            rid: Proposal(tokens, torch.stack(probs[rid]) if probs[rid] else None)
            for rid, tokens in drafts.items()
            if tokens
        }

    def release(self, request: Request) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
        self.generators.pop(request.request_id, None)

    # -- the draft's own KV ---------------------------------------------------------------------

    def _shadow(self, request: Request) -> Request:
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, [], request.params, 1, namespace_hash("draft"))
            shadow.all_token_ids = []
            self.shadows[request.request_id] = shadow
        return shadow

    def _sync(self, request: Request) -> None:
        """Cut the draft's KV back to what still matches the request's tokens."""
        shadow = self._shadow(request)
        tokens, have = request.all_token_ids, shadow.all_token_ids
        keep = 0
        limit = min(len(have), shadow.num_computed_tokens, len(tokens) - 1)
        while keep < limit and have[keep] == tokens[keep]:
            keep += 1
        shadow.all_token_ids = list(tokens[:keep])
        shadow.num_computed_tokens = keep
        self.kv.truncate(shadow, keep)

    def _missing(self, request: Request) -> list[int]:
        shadow = self.shadows[request.request_id]
        return list(request.all_token_ids[shadow.num_computed_tokens :])

    def _room(self, request: Request, num_new: int) -> bool:
        """Slots for `num_new` more draft tokens; without them the request gets no (more) proposal."""
        shadow = self.shadows[request.request_id]
        return self.kv.allocate_slots(shadow, num_new) is not None

    def _forward(self, batch: list[Request], feeds: dict[str, list[int]]) -> torch.Tensor:
        """Run each request's feed after its computed tokens; logits of each one's last row, in
        `batch` order."""
        chunks = []
        for request in batch:
            shadow, feed = self.shadows[request.request_id], feeds[request.request_id]
            shadow.all_token_ids += feed
            chunks.append(ScheduledChunk(shadow, shadow.num_computed_tokens, len(feed), 0))
        logits = self.runner.last_logits(chunks)
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end
        return logits

    # -- drawing -------------------------------------------------------------------------------

    def _draw(self, row: torch.Tensor, request: Request, extra: list[int]) -> tuple[int, torch.Tensor | None]:
        """A draft token and q (None for greedy requests: their acceptance only needs the token)."""
        params = request.params
        processed = self._adjust(row, request, extra)
        row = row if processed is None else processed
        if params.greedy:
            return int(row.argmax()), None
        q = filtered_probs(row, params.temperature, params.top_k, params.top_p, params.min_p)
        gen = self.generators.get(request.request_id)
        if gen is None:
            # Per sample (seed + index, as the sampler seeds the target's draws): the n samples of
            # one request must draft independently.
            base = params.seed if params.seed is not None else hash(request.group_id)
            seed = (base + request.index) ^ 0x5EED
            gen = self.generators[request.request_id] = torch.Generator().manual_seed(seed & ((1 << 62) - 1))
        return int(torch.multinomial(q, 1, generator=gen)), q
