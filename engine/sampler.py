"""Sampler: logits -> tokens, per request, with its own seeded generator.

Order per row, as in vLLM: raw log-probs are taken first (what `logprobs` reports), then logit
bias, min_tokens masking, penalties; greedy takes the argmax there; otherwise temperature, top-k,
top-p and min-p shape the distribution before one multinomial draw from the request's generator.
Each sample index of each request owns a generator, so a seeded request draws the same numbers
whatever else shares its batch.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from kvharbor.engine.core_io import fault_message
from kvharbor.engine.rejection import accept_greedy, accept_sampled
from kvharbor.engine.request import Logprob, Request, sample_id


@dataclass
class Sampled:
    """A step's draws, keyed by request id: tokens, logprobs (where asked for), and the rows
    whose own options failed them (a message each; no tokens)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)


@dataclass
class SampleRow:
    """Row `row` of the logits belongs to `request`; draw `num_samples` tokens from it."""

    row: int
    request: Request
    num_samples: int


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], seed: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._rng = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._group_seeds: dict[str, int] = {}
        self.mask_seconds = 0.0  # time spent masking structured outputs' rows (a step's share: metrics)

    def forget(self, request: Request) -> None:
        """Drop the generator state of a finished request."""
        self._generators.pop(request.request_id, None)
        if request.index == 0:
            self._group_seeds.pop(request.group_id, None)

    def _generator(self, request: Request, index: int) -> torch.Generator:
        # Sample i of a group uses seed + i: sample 0 is the parent, i > 0 the forked siblings.
        key = request.request_id if index == request.index else sample_id(request.group_id, index)
        gen = self._generators.get(key)
        if gen is None:
            base = request.params.seed
            if base is None:
                base = self._group_seeds.setdefault(request.group_id, self._rng.getrandbits(62))
            # Seeds are int64 (common/sampling_limits.SEED); sample i's wraps into manual_seed's
            # unsigned 64-bit range rather than overflow it.
            gen = torch.Generator().manual_seed((base + index) % 2**64)
            self._generators[key] = gen
        return gen

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """Draw tokens for every row. `logits` is float32 [len(rows), vocab]. Mutates only the
        generators. A row whose own options make it fail (its seed, bias, grammar) gets no
        tokens and a fault: the other rows are drawn as if it had not been there."""
        out = Sampled()
        need_lp = [r for r in rows if r.request.params.logprobs is not None]
        raw_lp = torch.log_softmax(logits[[r.row for r in need_lp]], dim=-1) if need_lp else None
        lp_row = {id(r): i for i, r in enumerate(need_lp)}
        argmax = logits.argmax(dim=-1).tolist()
        for r in rows:
            rid = r.request.request_id
            try:
                picked = self._pick(logits[r.row], argmax[r.row], r)
                if raw_lp is not None and id(r) in lp_row:
                    k = r.request.params.logprobs or 0
                    out.logprobs[rid] = [_logprob(raw_lp[lp_row[id(r)]], t, k) for t in picked]
            except Exception as exc:  # NOTE: one request's failure is its own (DESIGN.md: failure attribution)
                out.logprobs.pop(rid, None)
                out.faults[rid] = fault_message(exc)
                continue
            out.tokens[rid] = picked
        return out

    def _pick(self, row: torch.Tensor, argmax: int, r: SampleRow) -> list[int]:
        """The row's `num_samples` tokens under its request's options."""
        params = r.request.params
        processed = self.adjust(row, r.request)
        if r.request.guide is not None:
            processed = self._constrain(row, processed, r.request)
        picked = []
        for i in range(r.num_samples):
            if params.greedy:
                picked.append(argmax if processed is None else int(processed.argmax()))
            else:
                base = row if processed is None else processed
                picked.append(self._draw(base, r.request, r.request.index + i))
        return picked

    @torch.no_grad()
    def verify(
        self, logits: torch.Tensor, request: Request, draft: list[int], draft_probs: torch.Tensor | None
    ) -> tuple[list[int], list[Logprob] | None]:
        """Accept or reject `draft` (engine/rejection.py). `logits` [k + 1, vocab] float32: row j
        is the target's prediction after draft[:j]. Every sampling option is applied to each row
        as if draft[:j] had already been generated, so speculation changes no distribution."""
        params = request.params
        rows = []
        for j in range(len(draft) + 1):
            processed = self.adjust(logits[j], request, draft[:j])
            rows.append(logits[j] if processed is None else processed)
        if params.greedy:
            tokens = accept_greedy([int(r.argmax()) for r in rows], draft)
        else:
            probs = torch.stack([
                filtered_probs(r, params.temperature, params.top_k, params.top_p, params.min_p) for r in rows
            ])  # fmt: skip
            tokens = accept_sampled(probs, draft, draft_probs, self._generator(request, request.index))
        if params.logprobs is None:
            return tokens, None
        raw = torch.log_softmax(logits[: len(tokens)], dim=-1)
        return tokens, [_logprob(raw[j], t, params.logprobs) for j, t in enumerate(tokens)]

    def adjust(self, row: torch.Tensor, request: Request, extra: list[int] | None = None) -> torch.Tensor | None:
        """Bias, min_tokens and penalties; None when none applies (the raw row is used). `extra`:
        tokens taken as already generated after the request's own (speculated, being verified).
        A draft model's proposals get the same processing (engine/spec/draft.py's DraftSetup)."""
        p = request.params
        extra = extra or []
        mask_stop = len(request.output_token_ids) + len(extra) < p.min_tokens
        penal = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if not (p.logit_bias or mask_stop or penal):
            return None  # the common case: no copy of the request's tokens on the hot path
        out_ids = request.output_token_ids + extra
        row = row.clone()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
        if mask_stop:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            if stops:
                row[torch.tensor(sorted(stops), dtype=torch.long)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(request.all_token_ids + extra, dtype=torch.long).unique()
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return row

    def _constrain(self, row: torch.Tensor, processed: torch.Tensor | None, request: Request) -> torch.Tensor:
        """A copy of the row (`processed`, else the raw `row`) with every token the request's
        grammar does not take next at -inf (the logits the step shares stay as they were)."""
        t0 = time.perf_counter()
        allowed = request.guide.allowed()
        if not allowed.any():  # a grammar in error: end the sample rather than draw from nothing
            allowed[sorted(self.eos_token_ids)] = True
        banned = ~allowed[: row.shape[0]]
        out = (row if processed is None else processed).masked_fill(banned, float("-inf"))
        if processed is not None and bool(torch.isneginf(out).all()):
            # NOTE: min_tokens (or a banned stop token) masked every token the grammar takes: a
            # complete structure allows only EOS. The grammar decides: its tokens come back, so the
            # answer ends valid instead of drawing from an all -inf row (token 0, or noise).
            out = row.masked_fill(banned, float("-inf"))
        self.mask_seconds += time.perf_counter() - t0
        return out

    def _draw(self, row: torch.Tensor, request: Request, index: int) -> int:
        probs = filtered_probs(
            row, request.params.temperature, request.params.top_k, request.params.top_p, request.params.min_p
        )
        return int(torch.multinomial(probs, 1, generator=self._generator(request, index)))


def filtered_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution one sampled token is drawn from: softmax(row / T), restricted to the top-k,
    then to the smallest set whose mass reaches top_p, then to tokens >= min_p x the max, and
    renormalized."""
    # A tiny temperature or repetition penalty can overflow the logits: inf/nan would fail the
    # whole batch's draw, so they are clamped (finite rows are unchanged).
    scaled = torch.nan_to_num(row / temperature, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
    probs = torch.softmax(scaled, dim=-1)
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep a token if the mass strictly before it is below top_p (the crossing token stays).
        keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
        keep_sorted[0] = True  # a top_p that underflows to 0 still keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _logprob(raw: torch.Tensor, token: int, k: int) -> Logprob:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(raw, k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Logprob(token_id=token, logprob=float(raw[token]), top=top)
