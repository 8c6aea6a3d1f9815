"""GGUF's Q4_0, Q4_1 and Q8_0 blocks repacked into the kernel formats (engine/quantize.py), once
at load, never through a dense float copy (`--quantization gguf`).

A block is 32 consecutive elements of a row: an f16 scale d (and, in Q4_1, an f16 min m), then
the values. Q4_0: 16 bytes of nibbles, w = (q - 8) d. Q4_1: the same nibbles, w = q d + m.
Q8_0: 32 int8, w = q d. The nibbles keep their order (element j in byte j's low half, j + 16 in
its high half), which is the q4 format's, so only the scales move: to float32 arrays beside the
values. Q4_0's offset becomes a min of -8 d, exact in float32 (a power-of-two multiple of d).
"""

from __future__ import annotations

import numpy as np
import torch

from kvharbor.engine.quantize import GROUP, QuantWeight

# GGML type ids (the gguf package's GGMLQuantizationType) and each block's bytes.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


def repack(raw: np.ndarray, ggml_type: int, k: int) -> QuantWeight:
    """`raw`: a tensor's bytes as uint8 [n, k / 32 * block bytes] (rows of blocks, as the file
    holds them); returns the same values as a q4 or q8 QuantWeight of n x k."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGML type {ggml_type} is not one of the kept block types ({', '.join(NAMES.values())})")
    if k % GROUP:
        raise ValueError(f"a row of {k} elements is not whole {GROUP}-element blocks")
    n = raw.shape[0]
    blocks = raw.reshape(n, k // GROUP, BLOCK_BYTES[ggml_type])
    d = _f16(blocks[..., 0:2])
    if ggml_type == Q8_0:
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantWeight("q8", torch.from_numpy(values.copy()), torch.from_numpy(d), None, k)
    if ggml_type == Q4_1:
        mins, nibbles = _f16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        mins, nibbles = -8.0 * d, blocks[..., 2:]
    data = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(n, k // 2).copy())
    return QuantWeight("q4", data, torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(mins)), k)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[n, groups, 2] bytes of little-endian f16 -> float32 [n, groups]."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)
