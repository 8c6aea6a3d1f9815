"""8-bit KV cache (`--kv-cache-dtype int8|fp8`): each (token, KV head) row of K or V stored as
head_dim 8-bit codes and one bfloat16 scale, in one byte row of head_dim + 2.

    row: | c0 c1 ... c(D-1) | scale (bf16, 2 bytes) |      value_i = code_i * scale

- int8: scale = max|row| / 127, codes round to nearest (error at most half a step of the row).
- fp8: e4m3 codes of row / scale with scale = max|row| / 448 (e4m3's largest finite value), so
  each row uses the whole exponent range.

The scale is bfloat16, not float16: float16 has no range for the rows of small K/V values (a row
whose max is under 127 x 6e-5 got a subnormal scale, a few % off, and under 7.6e-6 a scale of 0),
while bfloat16 spans float32's range; its 8 bits of precision cost nothing, because the codes are
made with the stored scale, rounded up so that no code clamps.

Why per (token, head) and in the row: a token's K/V is written once, when it is computed, so its
scale is known then; a per-block scale would have to re-quantize a block whenever a later token
in it grows the range. Keeping the scale inside the row keeps the cache one tensor
`[layers, 2, kv_heads, slots, D + 2]` of bytes: block copies, offload, the shared store and
cross-instance pulls move its blocks as they move float ones, and the block format's dtype and
layout tags (engine/kv/kv_transfer.py) keep 8-bit blocks from ever meeting float ones. The scale
costs 2 bytes a row: SmolLM2 (30 layers, 3 KV heads, D 64) takes 2 x 30 x 3 x 66 = 11,880 bytes
per token against 46,080 in float32 (3.9x the tokens) and 23,040 in bfloat16 (1.94x).
"""

from __future__ import annotations

from typing import Literal

import torch

KVCacheDtype = Literal["auto", "int8", "fp8"]
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_BYTES = 2
_CODES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def row_bytes(head_dim: int, kv_dtype: str, element_size: int) -> int:
    """Bytes of one (token, head) row of K or V in the cache."""
    return head_dim + SCALE_BYTES if kv_dtype in _CODES else head_dim * element_size


def quantize_rows(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """[..., D] float rows -> [..., D + 2] uint8 rows (codes, then the bfloat16 scale)."""
    code_dtype, top = _CODES[kv_dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # bfloat16 first, so the codes are made with the very scale that is stored; 1 + 2^-8 rounds
    # it up (bfloat16 rounds by at most 2^-9), so |row| / scale <= top and no code clamps.
    scale = torch.where(amax > 0, amax * ((1 + 2.0**-8) / top), torch.ones_like(amax)).to(torch.bfloat16)
    scaled = x / scale.float()
    codes = torch.round(scaled).clamp_(-top, top).to(code_dtype) if kv_dtype == "int8" else scaled.to(code_dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, kv_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] uint8 rows -> [..., D] in `dtype`."""
    code_dtype, _ = _CODES[kv_dtype]
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].contiguous().view(code_dtype).float()
    scale = rows[..., d:].contiguous().view(torch.bfloat16).float()
    return (codes * scale).to(dtype)
