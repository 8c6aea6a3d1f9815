"""Paged attention, torch backend: the reference, and what runs on CPU.

The flat batch is ordered decodes first, then prefill chunks:

    tokens | d0 d1 ... d(B-1) | p0 p0 p0 ... | p1 p1 ... |
             one query each     one chunk per prefilling sequence

Each layer's KV lives in one tensor `[2 (K/V), kv_heads, num_blocks * block_size, head_dim]`
(with `--kv-cache-dtype int8|fp8`, byte rows of head_dim + 2: engine/kv/kv_quant.py):
head-major, so gathering a sequence's blocks yields `[kv_heads, ctx, head_dim]` rows that SDPA
reads without another copy; slot = block_id * block_size + offset. Every layer writes its new K/V
first, then attends, so a sequence may read blocks that another sequence of the same step is
writing (prefix hits on blocks registered this step).

Layers differ (`LayerAttention`, from engine/model/arch.py's ModelArch.attention): a
sliding-window layer attends to the last `window` positions only, and a layer may have its own
score scale (Gemma's query_pre_attn_scalar) and a soft-cap on its scores (Gemma 2). The step's
metadata carries the decode groups' and prefill chunks' masks once per window the model has
(`AttentionMetadata.windowed`).

NOTE (CPU speed, measured on 2 cores): SDPA with one query per sequence and `enable_gqa` is ~4x
slower than folding each KV head's query group into the query axis (q `[B, kv_heads, group, d]`),
and gathering whole blocks with index_select is ~3x faster than gathering slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from kvharbor.engine.kv.kv_quant import dequantize_rows, quantize_rows


@dataclass
class PrefillChunk:
    q_start: int  # first row in the flat batch
    q_len: int
    ctx_len: int  # keys: cached prefix + this chunk
    blocks: torch.Tensor | None  # block ids holding the context; None when ctx_len == q_len
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal aligned bottom-right


@dataclass
class DecodeGroup:
    """Decodes with similar context lengths, attended in one call (padded to the longest)."""

    start: int  # first row in the flat batch
    size: int
    blocks: torch.Tensor  # [size * max_blocks] block ids, padded with 0
    mask: torch.Tensor  # [size, 1, 1, max_blocks * block_size] additive 0 / -inf


@dataclass
class CpuDecode:
    """The first rows of the step in one call of the CPU kernel (engine/cpu/cpu_kernels.py), which
    reads the paged cache in place through the block tables: every decode, or (batch-invariant
    mode) every row, a prefill chunk's rows each with the context up to its own position."""

    kernels: Any  # cpu_kernels.CpuKernels
    tables: torch.Tensor  # [rows, max_blocks] int32, padded with 0
    ctx_lens: torch.Tensor  # [rows] int32
    runs: torch.Tensor | None = None  # int64 row offsets of each sequence's rows (tiled); None: a row each


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention needs beyond the step's metadata: its sliding window (None:
    the whole context), its score scale (None: head_dim ** -0.5) and its score soft-cap (None:
    none; else scores become softcap * tanh(score / softcap) before the mask, as HF's eager
    attention does)."""

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None


FULL = LayerAttention()


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    triton: Any = None  # attention_triton.TritonMetadata when the triton backend runs this step
    cpu_decode: CpuDecode | None = None  # decodes through the CPU kernel instead of decode_groups
    kv_dtype: str = "auto"  # int8 / fp8: the cache holds engine/kv/kv_quant.py's byte rows
    kv_writer: Any = None  # cpu_kernels.CpuKernels: writes float32 or int8 rows instead of torch ops
    slot_bounds: tuple[int, int] | None = None  # min and max of slot_mapping, for the writer's check
    # Each sliding window the model has: its decode groups and prefill chunks (masks banded to it).
    windowed: dict[int, tuple[list[DecodeGroup], list[PrefillChunk]]] = field(default_factory=dict)

    def parts(self, window: int | None) -> tuple[list[DecodeGroup], list[PrefillChunk]]:
        """The torch path's decode groups and prefill chunks for a layer with this window."""
        return (self.decode_groups, self.prefills) if window is None else self.windowed[window]


# One more decode call costs about as much as attending to this many more padded key positions
# (measured on CPU: ~0.1 ms per call vs ~0.2 us per position).
CALL_COST_POSITIONS = 512
# NOTE: a group's gathered K/V must stay in cache for SDPA to read it back: 64 sequences x 400
# positions in one call took 18.5 ms on 2 cores, the same in four calls of 16 took 6 ms.
MAX_GROUP_POSITIONS = 8192


def decode_groups(ctx_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decodes, sorted by context length ascending, into (start, size) groups that minimize
    padded positions + CALL_COST_POSITIONS per group, each at most MAX_GROUP_POSITIONS padded
    positions unless it is a single sequence (an O(n^2) partition; n <= max_num_seqs)."""
    n = len(ctx_lens)
    padded = [-(-c // block_size) * block_size for c in ctx_lens]
    best = [0.0] + [float("inf")] * n  # best[i]: cost of grouping the first i decodes
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            size = (end - start) * padded[end - 1]
            if size > MAX_GROUP_POSITIONS and end - start > 1:
                continue
            cost = best[start] + CALL_COST_POSITIONS + size
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append((cut[end], end - cut[end]))
        end = cut[end]
    return groups[::-1]


def build_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    num_decodes: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "torch",
    kv_shape: tuple[int, int] = (0, 0),  # (kv_heads, head_dim), for the triton backend
    cpu_kernels: Any = None,  # cpu_kernels.CpuKernels: decodes through its attention kernel
    kv_dtype: str = "auto",  # the cache's --kv-cache-dtype
    invariant: bool = False,  # batch-invariant: every row through cpu_kernels' kernel
    windows: tuple[int, ...] = (),  # the model's sliding windows (engine/model/arch.py)
) -> AttentionMetadata:
    """Metadata for sequences (decodes first) with these block tables, computed prefixes
    (`starts`) and new-token counts (`lengths`)."""
    slots: list[int] = []
    for table, start, n in zip(block_tables, starts, lengths, strict=True):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    if invariant:
        meta = _invariant_metadata(block_tables, starts, lengths, num_decodes, block_size, slots, cpu_kernels, kv_dtype)
        meta.windowed = {w: ([], []) for w in windows}  # the kernel takes every row, windowed by its argument
        return meta
    if backend == "triton":
        from kvharbor.engine.model.attention_triton import build_triton_metadata

        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        tmeta = build_triton_metadata(block_tables, starts, lengths, num_decodes, block_size, *kv_shape, device)
        return AttentionMetadata(block_size, slot_mapping, num_decodes, [], [], tmeta)
    ctx_lens = [s + 1 for s in starts[:num_decodes]]
    cpu_decode = None
    if cpu_kernels is not None and num_decodes and kv_dtype in ("auto", "int8"):  # the kernel reads no fp8
        width = max(len(t) for t in block_tables[:num_decodes])
        padded = [t + [0] * (width - len(t)) for t in block_tables[:num_decodes]]
        tables, lens = torch.tensor(padded, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32)
        cpu_decode = CpuDecode(cpu_kernels, tables, lens)
        ctx_lens = []  # no decode groups: the kernel takes them all
    seqs = _Seqs(block_tables, starts, lengths, num_decodes, ctx_lens, block_size, dtype, device)
    groups, prefills = seqs.parts(None)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    writer = cpu_kernels if kv_dtype in ("auto", "int8") else None
    return AttentionMetadata(
        block_size, slot_mapping, num_decodes, groups, prefills, cpu_decode=cpu_decode, kv_dtype=kv_dtype,
        kv_writer=writer, slot_bounds=(min(slots), max(slots)) if slots else None,
        windowed={w: seqs.parts(w) for w in windows},
    )  # fmt: skip


@dataclass
class _Seqs:
    """The step's sequences, as the torch path's decode groups and prefill chunks are built from."""

    block_tables: list[list[int]]
    starts: list[int]
    lengths: list[int]
    num_decodes: int
    ctx_lens: list[int]  # the decodes' that go to decode groups (none when the CPU kernel takes them)
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @cached_property
    def partition(self) -> list[tuple[int, int]]:
        """The decode groups' (start, size): the same for every window."""
        return decode_groups(self.ctx_lens, self.block_size)

    def parts(self, window: int | None) -> tuple[list[DecodeGroup], list[PrefillChunk]]:
        """Decode groups and prefill chunks whose masks hide what lies outside `window` (None: causal only)."""
        nd, bs = self.num_decodes, self.block_size
        groups = []
        for start, size in self.partition:
            rows = slice(start, start + size)
            groups.append(
                _decode_group(start, self.block_tables[rows], self.ctx_lens[rows], bs, self.dtype, self.device, window)
            )
        prefills = []
        q_start = nd
        for table, start, n in zip(self.block_tables[nd:], self.starts[nd:], self.lengths[nd:], strict=True):
            prefills.append(_prefill_chunk(q_start, table, start, n, bs, self.device, window))
            q_start += n
        return groups, prefills


def _prefill_chunk(
    q_start: int, table: list[int], start: int, n: int, block_size: int, device: torch.device, window: int | None
) -> PrefillChunk:
    """A chunk of n tokens after `start` cached ones; its mask is causal, and banded to `window`."""
    banded = window is not None and start + n > window
    if start == 0 and not banded:
        return PrefillChunk(q_start, n, n, None, None)
    mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
    if banded:  # query start+i sees keys j with start+i - window < j
        mask = mask.triu(start - window + 1)
    if start == 0:
        return PrefillChunk(q_start, n, n, None, mask)
    used = -(-(start + n) // block_size)
    blocks = torch.tensor(table[:used], dtype=torch.long, device=device)
    return PrefillChunk(q_start, n, start + n, blocks, mask)


def _invariant_metadata(
    block_tables: list[list[int]], starts: list[int], lengths: list[int], num_decodes: int, block_size: int,
    slots: list[int], kernels: Any, kv_dtype: str,
) -> AttentionMetadata:
    """Every row of the step through the CPU kernel, each as one query over the context up to its
    own position (written first): the same computation for a token whether it is decoded alone,
    in a batch, in a prefill chunk of any size, or recomputed after a preemption. A sequence's rows
    go as one run, which the kernel attends in tiles that share their K/V reads."""
    if kernels is None or kv_dtype == "fp8":
        raise ValueError("batch-invariant attention needs the CPU kernels and a float32, bfloat16 or int8 KV cache")
    rows = sum(lengths)
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    tables = torch.zeros(rows, width, dtype=torch.int32)
    ctx_lens = torch.empty(rows, dtype=torch.int32)
    r, runs = 0, [0]
    for table, start, n in zip(block_tables, starts, lengths, strict=True):
        used = -(-(start + n) // block_size)
        tables[r : r + n, :used] = torch.tensor(table[:used], dtype=torch.int32)
        ctx_lens[r : r + n] = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        r += n
        runs.append(r)
    return AttentionMetadata(
        block_size, torch.tensor(slots, dtype=torch.long), num_decodes, [], [],
        cpu_decode=CpuDecode(kernels, tables, ctx_lens, torch.tensor(runs, dtype=torch.int64)), kv_dtype=kv_dtype,
        kv_writer=kernels,
        slot_bounds=(min(slots), max(slots)) if slots else None,
    )  # fmt: skip


def _decode_group(
    start: int, tables: list[list[int]], ctx_lens: list[int], block_size: int, dtype: torch.dtype,
    device: torch.device, window: int | None = None,
) -> DecodeGroup:  # fmt: skip
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device).view(-1)
    ctx = torch.tensor(ctx_lens, device=device)
    pos = torch.arange(width * block_size, device=device)[None, :]
    visible = pos < ctx[:, None]
    if window is not None:
        visible &= pos >= ctx[:, None] - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return DecodeGroup(start, len(tables), blocks, mask.view(len(tables), 1, 1, -1))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, kv_dtype: str, dtype: torch.dtype):
    """[kv_heads, len(blocks) * block_size, dim] rows of these blocks, in order (8-bit rows
    dequantized to `dtype`)."""
    kv_heads, _, row = cache.shape
    rows = cache.view(kv_heads, -1, block_size * row).index_select(1, blocks).view(kv_heads, -1, row)
    return rows if kv_dtype == "auto" else dequantize_rows(rows, kv_dtype, dtype)


def _write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
    """Write this step's K/V at their slots; returns the K/V attention must use for them: as
    given, or (8-bit cache) as the cache holds them, so a prefix read back later from the cache
    gives what its first computation gave. Only fresh prefill chunks read them back (decodes and
    chunks with a cached prefix read the cache), so an 8-bit step without one returns None."""
    slots, writer = meta.slot_mapping, meta.kv_writer if k.dtype == torch.float32 else None
    if meta.kv_dtype == "auto":
        if writer is not None and kv_cache.dtype in (torch.float32, torch.bfloat16):  # bfloat16: rounded
            writer.kv_write(k, slots, kv_cache[0], meta.slot_bounds)
            writer.kv_write(v, slots, kv_cache[1], meta.slot_bounds)
        else:  # (float32 activations into a bfloat16 cache without the kernels)
            kv_cache[0].index_copy_(1, slots, k.transpose(0, 1).to(kv_cache.dtype))
            kv_cache[1].index_copy_(1, slots, v.transpose(0, 1).to(kv_cache.dtype))
        return k, v
    if writer is not None:  # the AVX2 kernel: the same bytes
        writer.kv_write_int8(k, slots, kv_cache[0], meta.slot_bounds)
        writer.kv_write_int8(v, slots, kv_cache[1], meta.slot_bounds)
        k_rows = v_rows = None
    else:
        k_rows, v_rows = quantize_rows(k, meta.kv_dtype), quantize_rows(v, meta.kv_dtype)
        kv_cache[0].index_copy_(1, slots, k_rows.transpose(0, 1))
        kv_cache[1].index_copy_(1, slots, v_rows.transpose(0, 1))
    if not any(p.blocks is None for p in meta.prefills):
        return None, None
    if k_rows is None:  # written by the kernel: read this step's rows back
        k_rows = kv_cache[0].index_select(1, slots).transpose(0, 1)
        v_rows = kv_cache[1].index_select(1, slots).transpose(0, 1)
    return dequantize_rows(k_rows, meta.kv_dtype, k.dtype), dequantize_rows(v_rows, meta.kv_dtype, v.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k: torch.Tensor,  # [T, kv_heads, dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, kv_heads, slots, dim]
    meta: AttentionMetadata,
    layer: LayerAttention = FULL,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, heads, dim]."""
    if meta.triton is not None:
        from kvharbor.engine.model.attention_triton import triton_paged_attention

        return triton_paged_attention(
            q, k, v, kv_cache, meta.slot_mapping, meta.num_decodes, meta.block_size, meta.triton
        )
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kv_heads = k.shape[1]
    k, v = _write(kv_cache, k, v, meta)
    kvd = meta.kv_dtype
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    bs = meta.block_size
    if (cpu := meta.cpu_decode) is not None:
        n = cpu.tables.shape[0]
        how = dict(scale=layer.scale, window=layer.window or 0, softcap=layer.softcap or 0.0, runs=cpu.runs)
        if q.dtype == torch.float32:
            cpu.kernels.decode_attention(q[:n], k_cache, v_cache, cpu.tables, cpu.ctx_lens, bs, out[:n], **how)
        else:  # bfloat16: the kernel takes float32 queries (widened exactly) and writes float32
            o = torch.empty(n, heads, dim, dtype=torch.float32)
            cpu.kernels.decode_attention(q[:n].float(), k_cache, v_cache, cpu.tables, cpu.ctx_lens, bs, o, **how)
            out[:n] = o
    groups, prefills = meta.parts(layer.window)
    for g in groups:
        rows = slice(g.start, g.start + g.size)
        keys = _gather(k_cache, g.blocks, bs, kvd, q.dtype).view(kv_heads, g.size, -1, dim).transpose(0, 1)
        values = _gather(v_cache, g.blocks, bs, kvd, q.dtype).view(kv_heads, g.size, -1, dim).transpose(0, 1)
        query = q[rows].view(g.size, kv_heads, heads // kv_heads, dim)
        o = _attend(query, keys, values, g.mask, layer)
        out[rows] = o.reshape(g.size, heads, dim)
    for p in prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.blocks is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys = _gather(k_cache, p.blocks, bs, kvd, q.dtype)[:, : p.ctx_len]
            values = _gather(v_cache, p.blocks, bs, kvd, q.dtype)[:, : p.ctx_len]
        query = q[rows].transpose(0, 1).unsqueeze(0)
        o = _attend(query, keys.unsqueeze(0), values.unsqueeze(0), p.mask, layer, gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, layer: LayerAttention,
    gqa: bool = False,
) -> torch.Tensor:  # fmt: skip
    """SDPA over [batch, heads, rows, dim]; a None mask is causal. `gqa`: k/v have fewer heads than
    q, each shared by a run of query heads. A soft-capped layer takes the explicit path (SDPA
    has no soft-cap): scores in float32, capped, masked, softmaxed, as HF's eager attention."""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                              enable_gqa=gqa)  # fmt: skip
    if gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if layer.scale is None else layer.scale
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1).to(v.dtype)) @ v
