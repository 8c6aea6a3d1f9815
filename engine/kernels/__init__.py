"""Triton kernels of the `triton` attention backend (engine/model/attention_triton.py): they read and write the paged KV
cache `[2 (K/V), kv_heads, num_blocks * block_size, head_dim]` in place, through slot mappings and
block tables, with no gathering into contiguous tensors.

On a CPU they run under the Triton interpreter (TRITON_INTERPRET=1), which is how the tests prove
them against the torch backend; `interpreted()` tells the kernels to do their dots in float32,
since the interpreter's `tl.dot` on bfloat16 inputs returns garbage.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
