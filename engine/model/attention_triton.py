"""The `triton` attention backend: the paged cache read and written in place by the kernels in
engine/kernels/, never gathered into contiguous tensors (that is the torch backend,
engine/model/attention.py, which stays the reference and what runs on CPU).

Per step: `write_kv` scatters the new K/V through the slot mapping, then decodes (first in the
flat batch) go to `decode_attention`, split-KV when `choose_splits` says the grid is too small
for the GPU, and prefill chunks to `prefill_attention`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


@dataclass
class TritonMetadata:
    scale: float
    decode_tables: torch.Tensor  # [decodes, max_blocks] int32
    decode_lens: torch.Tensor  # [decodes] int32, context length including the new token
    splits: int
    prefill_tables: torch.Tensor  # [chunks, max_blocks] int32
    q_starts: torch.Tensor  # [chunks] int32, row of each chunk's first token in the flat batch
    q_lens: torch.Tensor  # [chunks] int32
    ctx_lens: torch.Tensor  # [chunks] int32, cached prefix + the chunk
    max_q_len: int


def resolve_backend(
    name: str, device: torch.device, block_size: int, kv_dtype: str = "auto", unsupported: str | None = None
) -> str:
    """`auto` is triton on CUDA and torch elsewhere, and torch with an 8-bit KV cache (the Triton
    kernels read float KV only) or a model feature they do not cover (`unsupported` names it:
    sliding windows, soft-caps, a non-default score scale); an impossible choice fails with what to do."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if unsupported and name == "triton":
        raise ValueError(
            f"the Triton attention kernels do not cover this model's {unsupported}: use --attention-backend torch "
            "(or auto, which picks it)"
        )
    if unsupported and name == "auto":
        if device.type == "cuda":
            log.warning("attention runs on the torch backend: the Triton kernels do not cover %s", unsupported)
        return "torch"
    if kv_dtype != "auto" and name == "triton":
        raise ValueError(
            f"--kv-cache-dtype {kv_dtype} runs on the torch attention backend (the Triton kernels read float KV): "
            "drop --attention-backend triton, or use --kv-cache-dtype auto"
        )
    if name == "auto":
        name = "triton" if device.type == "cuda" and kv_dtype == "auto" else "torch"
    if name == "torch":
        return name
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("attention_backend=triton needs Triton: pip install 'kvharbor[triton]'") from None
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            "attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1, for testing); "
            "use --attention-backend torch on CPU"
        )
    if block_size < 16:
        raise ValueError(f"attention_backend=triton needs block_size >= 16 (tl.dot tiles), got {block_size}")
    return name


def _table(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int32, device=device)


def build_triton_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    num_decodes: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> TritonMetadata:
    from kvharbor.engine.kernels.decode import choose_splits

    decode_lens = [s + 1 for s in starts[:num_decodes]]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    splits = choose_splits(num_decodes, kv_heads, max(decode_lens, default=0), block_size, sms)
    q_starts, row = [], num_decodes
    for n in lengths[num_decodes:]:
        q_starts.append(row)
        row += n
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return TritonMetadata(
        scale=head_dim**-0.5,
        decode_tables=_table(block_tables[:num_decodes], device),
        decode_lens=as_int(decode_lens),
        splits=splits,
        prefill_tables=_table(block_tables[num_decodes:], device),
        q_starts=as_int(q_starts),
        q_lens=as_int(lengths[num_decodes:]),
        ctx_lens=as_int([s + n for s, n in zip(starts[num_decodes:], lengths[num_decodes:], strict=True)]),
        max_q_len=max(lengths[num_decodes:], default=0),
    )


def triton_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_decodes: int, block_size: int, meta: TritonMetadata,
) -> torch.Tensor:  # fmt: skip
    """Write this step's K/V into the cache, then attend. q [T, heads, dim] -> [T, heads, dim]."""
    from kvharbor.engine.kernels.decode import decode_attention
    from kvharbor.engine.kernels.kv_write import write_kv
    from kvharbor.engine.kernels.prefill import prefill_attention

    write_kv(k, v, kv_cache, slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_decodes:
        decode_attention(
            q[:num_decodes], kv_cache, meta.decode_tables, meta.decode_lens, block_size, meta.scale,
            splits=meta.splits, out=out[:num_decodes],
        )  # fmt: skip
    if meta.max_q_len:
        prefill_attention(
            q, kv_cache, meta.prefill_tables, meta.q_starts, meta.q_lens, meta.ctx_lens, meta.max_q_len,
            block_size, meta.scale, out,
        )  # fmt: skip
    return out
