"""KV capacity: how many blocks fit the memory budget (a runtime value, never written to config)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvharbor.common.config import parse_bytes
from kvharbor.engine.config import CacheConfig
from kvharbor.engine.kv.kv_quant import row_bytes

if TYPE_CHECKING:  # the model's shape, read for sizing: the model wing sits above kv/
    from kvharbor.engine.model.arch import ModelArch

GiB = 1024**3
# On CPU the pool shares RAM with everything else: default to a fifth of what is free, at most 2 GiB.
CPU_DEFAULT_SHARE = 0.2
CPU_DEFAULT_CAP = 2 * GiB


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # 2 x layers x kv_heads x (head_dim x dtype bytes, or head_dim + 2 in 8 bits)
    max_model_len: int  # the context the engine serves: asked for, or the model's, capped to the pool
    model_limit: int  # the model's own context (ModelArch.context_limit)
    capped: bool = False  # max_model_len was not asked for, and the pool holds less than model_limit

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def cap_note(self) -> str:
        return (
            f"max_model_len capped to {self.max_model_len} tokens, what the KV pool holds (the model allows "
            f"{self.model_limit}): give the pool more with --kv-cache-memory or --num-kv-blocks to raise it"
        )


def check_max_model_len(asked: int | None, model_limit: int, model_name: str) -> None:
    """Refuse an asked-for context longer than the model's, before any weights are built."""
    if asked is not None and asked > model_limit:
        raise ValueError(f"max_model_len {asked} exceeds what {model_name} supports ({model_limit})")


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool on `device` right now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_capacity(
    arch: ModelArch,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    shadow_bytes_per_token: int = 0,
    reserved_bytes: int = 0,
    step_tokens: int | None = None,
) -> KVCapacity:
    """Size the pool, and the context it serves. `max_model_len` None means the model's own limit,
    capped to what the pool holds; an explicit one that does not fit raises ValueError with the
    numbers. `shadow_bytes_per_token`: a draft model's KV per token; its pool holds as many tokens
    as this one and comes out of the same memory budget. `reserved_bytes` (LoRA adapters) come out of
    a memory budget before the pool is cut from it; --num-kv-blocks is exact and takes no share.
    `step_tokens` (the scheduler's max_num_batched_tokens): with a model whose every layer slides
    (ModelArch.kv_window) a request holds only its window's blocks and one step's (the KV cache
    manager releases the rest), so a context longer than the pool still fits."""
    element = torch.empty((), dtype=dtype).element_size()
    row = row_bytes(arch.head_dim, cache.kv_cache_dtype, element)  # one token's K or V row of one head
    per_token = 2 * arch.num_layers * arch.num_kv_heads * row
    per_block = (per_token + shadow_bytes_per_token) * cache.block_size
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
        budget = num_blocks * per_block
    else:
        if cache.kv_cache_memory is not None:
            budget = parse_bytes(cache.kv_cache_memory)
        elif device.type == "cuda":
            budget = int(available_memory(device) * cache.kv_memory_fraction)
        else:
            budget = min(CPU_DEFAULT_CAP, int(available_memory(device) * CPU_DEFAULT_SHARE))
        if reserved_bytes >= budget:
            raise ValueError(
                f"LoRA adapters reserve {reserved_bytes / GiB:.2f} GiB of the {budget / GiB:.2f} GiB memory budget, "
                "leaving no KV pool: raise --kv-cache-memory, or lower --max-loras / --max-cpu-loras / --max-lora-rank"
            )
        budget -= reserved_bytes
        num_blocks = budget // per_block
    limit = arch.context_limit
    tokens = num_blocks * cache.block_size
    held = f"the KV pool holds {num_blocks} blocks ({tokens} tokens, {budget / GiB:.2f} GiB at {per_token} bytes/token)"
    if tokens < 2:
        raise ValueError(f"{held}, too few for any request: give it more (--kv-cache-memory / --num-kv-blocks)")
    want = max_model_len or limit
    needed = blocks_for_one_request(want, cache.block_size, arch.kv_window, step_tokens)
    if num_blocks < needed and max_model_len is not None:
        raise ValueError(
            f"{held} but one {want}-token request needs {needed}: "
            "lower --max-model-len or give the pool more memory (--kv-cache-memory / --num-kv-blocks)"
        )
    fits = num_blocks >= needed
    served = want if fits else min(want, tokens - (cache.block_size if arch.kv_window else 0))  # less the null block
    if served < 2:
        raise ValueError(f"{held}, too few for any request: give it more (--kv-cache-memory / --num-kv-blocks)")
    return KVCapacity(num_blocks, cache.block_size, per_token, served, limit, max_model_len is None and not fits)


def blocks_for_one_request(tokens: int, block_size: int, window: int | None, step_tokens: int | None) -> int:
    """The most blocks one request of `tokens` holds at once. Under a window every layer slides in,
    a step of n new tokens from position p holds the blocks from (p - window + 1) / block_size to
    (p + n - 1) / block_size, at most (window + n - 2) / block_size + 2, plus the null block in
    the released slots (engine/kv/kv_cache_manager.py)."""
    whole = -(-tokens // block_size)
    if window is None or step_tokens is None:
        return whole
    return min(whole, (window + step_tokens - 2) // block_size + 2) + 1
