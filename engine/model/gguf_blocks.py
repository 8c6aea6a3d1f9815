"""GGUF's quantized blocks in the kernel formats (engine/quantize.py), once at load, never through
a dense float copy of the model (`--quantization gguf`).

Kept exactly (the kernels multiply the file's own values):
- Q4_0, Q4_1, Q8_0: 32 elements a block, an f16 scale d (Q4_1: and a min m). Q4_0: 16 bytes of
  nibbles, w = (q - 8) d; Q4_1: w = q d + m; Q8_0: 32 int8, w = q d. The nibbles keep their
  order (element j in byte j's low half, j + 16 in its high half), the q4 format's, so only
  the scales move. Q4_0's offset becomes a min of -8 d, exact in float32.
- Q4_K: 256 elements in eight 32-element sub-blocks, each w = q d sc - dmin m with 6-bit sc and
  m packed in 12 bytes. Each sub-block is a q4 group (scale d sc, min -dmin m: products of an
  f16 and an integer below 64, exact in float32); the nibbles are re-paired, since Q4_K puts
  sub-block 2c in the low halves of 32 bytes and 2c + 1 in their high halves.
- Q5_0: 32 elements, d, 32 high bits, 16 bytes of low nibbles; w = (q - 16) d with q in 0..31,
  an int8 times d: q8, exactly (8 bits a weight where the file spends 5.5).

Requantized: Q5_K and Q6_K have a scale per 16 elements (Q6_K) or a min (Q5_K) that no one
32-group scale holds, so they become q8 (int8 per 32 at max|w| / 127), a row slice at a time;
each weight moves by at most half a q8 step, a quarter of Q6_K's own step or less. llama.cpp's
Q4_K_M files keep the most sensitive tensors (some ffn_down, attn_v) in Q6_K, so this is where a
"kept" file is not bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from kvharbor.engine.quantize import GROUP, SCRATCH_FLOATS, QuantWeight, concat, quantize_q8

# GGML type ids (the gguf package's GGMLQuantizationType), each block's bytes and elements.
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 8, 12, 13, 14
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
BLOCK_ELEMENTS = {Q4_K: 256, Q5_K: 256, Q6_K: 256}  # the rest: GROUP
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
REQUANTIZED = (Q5_K, Q6_K)


def repack(raw: np.ndarray, ggml_type: int, k: int) -> QuantWeight:
    """`raw`: a tensor's bytes as uint8 [n, k / block elements * block bytes] (rows of blocks, as
    the file holds them); returns its values as a q4 or q8 QuantWeight of n x k."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGML type {ggml_type} is not one of the kept block types ({', '.join(NAMES.values())})")
    per_block = BLOCK_ELEMENTS.get(ggml_type, GROUP)
    if k % per_block:
        raise ValueError(f"a row of {k} elements is not whole {per_block}-element {NAMES[ggml_type]} blocks")
    n = raw.shape[0]
    blocks = raw.reshape(n, k // per_block, BLOCK_BYTES[ggml_type])
    if ggml_type in REQUANTIZED:
        return _requantized(raw, ggml_type, n, k)
    if ggml_type == Q4_K:
        return _q4_k(blocks, n, k)
    d = _f16(blocks[..., 0:2])
    if ggml_type == Q8_0:
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantWeight("q8", torch.from_numpy(values.copy()), torch.from_numpy(d), None, k)
    if ggml_type == Q5_0:
        return QuantWeight("q8", torch.from_numpy(_q5_0_values(blocks).reshape(n, k)), torch.from_numpy(d), None, k)
    if ggml_type == Q4_1:
        mins, nibbles = _f16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        mins, nibbles = -8.0 * d, blocks[..., 2:]
    data = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(n, k // 2).copy())
    return QuantWeight("q4", data, torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(mins)), k)


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [n, b, 22] -> int8 [n, b, 32]: q - 16, the fifth bit of element j being bit j
    of the block's little-endian 32-bit qh."""
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [n, b, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    qs = blocks[..., 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # elements 0..15, then 16..31
    return ((low | high).astype(np.int16) - 16).astype(np.int8)


def _q4_k(blocks: np.ndarray, n: int, k: int) -> QuantWeight:
    """Q4_K blocks [n, b, 144] (d, dmin, 12 bytes of scales, 128 of nibbles) as q4 groups."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])  # [n, b, 8]
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 32 bytes per pair of sub-blocks
    subs = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k // GROUP, GROUP)  # sub-block order
    nibbles = subs[..., : GROUP // 2] | (subs[..., GROUP // 2 :] << 4)
    scale = (d[..., None] * sc).reshape(n, -1)
    mins = -(dmin[..., None] * m).reshape(n, -1)
    data = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(n, k // 2))
    return QuantWeight("q4", data, torch.from_numpy(scale), torch.from_numpy(mins), k)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block from its 12 bytes, as float32:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles
    of bytes 8-11 with their top two bits in the top bits of bytes 0-7."""
    s = packed.astype(np.uint8)
    lo_sc, lo_m, tail = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (tail & 15) | ((lo_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([lo_m & 63, (tail >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _requantized(raw: np.ndarray, ggml_type: int, n: int, k: int) -> QuantWeight:
    """Q5_K/Q6_K rows dequantized a slice at a time (bounded scratch) and made q8."""
    from gguf.quants import dequantize

    step = max(1, SCRATCH_FLOATS // k)
    parts = []
    for first in range(0, n, step):
        dense = dequantize(np.ascontiguousarray(raw[first : first + step]), ggml_type)
        parts.append(quantize_q8(torch.from_numpy(np.asarray(dense, np.float32))))
    return concat(parts)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[n, groups, 2] bytes of little-endian f16 -> float32 [n, groups]."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)
