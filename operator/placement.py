"""Placement: which GPU node pool, and how many GPUs per replica, fit a model.

Pools come from Nodes grouped by a label. Per pool the NVIDIA feature-discovery labels give the
GPU product (`nvidia.com/gpu.product`) and memory per GPU (`nvidia.com/gpu.memory`, MiB), and
allocatable `nvidia.com/gpu` how many GPUs a node offers. A replica runs on one node, its GPUs
splitting the weights and the KV cache (tensor parallel, a power of two that divides the KV heads).

A replica fits when weights + KV for maxNumSeqs x maxModelLen tokens + its LoRA adapters fit in the
GPUs' memory less a workspace headroom (activations, CUDA context, allocator slack). LoRA
adapters count as the engine reserves them (ModelProfile.lora_bytes): maxLoras slots and
maxCpuLoras loaded adapters, each at maxLoraRank on every projection (q, k, v, o, gate, up, down).
Among the fits the smallest is chosen: the least GPU memory per replica, then the fewest GPUs.
When nothing fits, the reasons say, per pool, how much was needed and how much there was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvharbor.operator.model_profiles import ModelProfile

GiB = 1 << 30
POOL_LABEL = "kvharbor.io/pool"
HEADROOM_FRACTION = 0.10  # of each GPU's memory
HEADROOM_MIN_BYTES = 1 * GiB  # per GPU


@dataclass(frozen=True)
class Pool:
    name: str
    gpu_product: str | None
    gpu_memory_bytes: int  # per GPU
    gpus_per_node: int  # the most any node of the pool offers
    nodes: int


@dataclass(frozen=True)
class EngineShape:
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_memory_fraction: float = 1.0  # of what is left after weights and headroom
    quantization: str = "none"  # the engine's --quantization: weights at their quantized size
    kv_cache_dtype: str = "auto"  # the engine's --kv-cache-dtype: int8 / fp8 rows are head_dim + 2 bytes
    gguf_bits: int = 8  # gguf: the file's blocks are 4-bit (Q4_0/Q4_1) or 8-bit (Q8_0)
    lora_slots: int = 0  # the engine's --max-loras (0: LoRA off)
    lora_rank: int = 0  # --max-lora-rank
    lora_loaded: int = 0  # --max-cpu-loras
    # vLLM's --gpu-memory-utilization: the share of each GPU it takes for weights, activations and
    # KV together (None: a kvharbor engine, sized by the headroom and kv_memory_fraction instead)
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class PlacementPlan:
    pool: str
    gpus_per_replica: int
    kv_capacity_tokens: int
    bytes_per_token: int
    weight_bytes: int
    gpu_product: str | None
    adapter_bytes: int = 0  # what the engine reserves for LoRA (see the module docstring)


def pools_from_nodes(nodes: Sequence[Mapping[str, Any]], pool_label: str = POOL_LABEL) -> list[Pool]:
    """Group Node objects (as the API returns them) into pools."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for node in nodes:
        labels = node.get("metadata", {}).get("labels", {}) or {}
        grouped.setdefault(labels.get(pool_label, "default"), []).append(node)
    pools = []
    for name, members in sorted(grouped.items()):
        gpus = [_int(n.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu")) for n in members]
        labels = [n.get("metadata", {}).get("labels", {}) or {} for n in members]
        memory = min((_int(lb.get("nvidia.com/gpu.memory")) for lb in labels), default=0)
        products = {lb.get("nvidia.com/gpu.product") for lb in labels if lb.get("nvidia.com/gpu.product")}
        pools.append(
            Pool(name, ",".join(sorted(products)) or None, memory * (1 << 20), max(gpus, default=0), len(members))
        )
    return pools


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def usable_bytes(pool: Pool, gpus: int, utilization: float | None = None) -> int:
    """Weights + KV + adapters room on `gpus` GPUs: each GPU less the headroom, or (vLLM) its
    `utilization` share less HEADROOM_MIN_BYTES of activations, which vLLM takes out of that share."""
    if utilization is not None:
        return gpus * (int(pool.gpu_memory_bytes * utilization) - HEADROOM_MIN_BYTES)
    headroom = max(HEADROOM_MIN_BYTES, int(pool.gpu_memory_bytes * HEADROOM_FRACTION))
    return gpus * (pool.gpu_memory_bytes - headroom)


def place(
    model: ModelProfile,
    engine: EngineShape,
    pools: Sequence[Pool],
    node_pool: str | None = None,
    gpu_type: str | None = None,
    gpus_per_replica: int | None = None,
) -> PlacementPlan | list[str]:
    """The smallest fit, or the reasons (one per pool) why nothing fits."""
    weights = model.weight_bytes(engine.dtype, engine.quantization, engine.gguf_bits)
    per_token = model.kv_bytes_per_token(engine.dtype, engine.kv_cache_dtype)
    kv_needed = engine.max_num_seqs * engine.max_model_len * per_token
    adapters = 0
    if engine.lora_slots:
        adapters = model.lora_bytes(engine.lora_slots, engine.lora_rank, engine.lora_loaded, engine.dtype)
    need = weights + kv_needed + adapters
    fits: list[tuple[int, int, str, PlacementPlan]] = []
    reasons: list[str] = []
    candidates = [p for p in pools if node_pool is None or p.name == node_pool]
    if node_pool is not None and not candidates:
        return [f"node pool {node_pool!r} does not exist; pools: {', '.join(p.name for p in pools) or 'none'}"]
    for pool in candidates:
        why = _unusable(pool, gpu_type)
        if why:
            reasons.append(f"pool {pool.name}: {why}")
            continue
        counts = [g for g in (1, 2, 4, 8, 16) if g <= pool.gpus_per_node and model.kv_heads % g == 0]
        if gpus_per_replica is not None:
            counts = [g for g in counts if g == gpus_per_replica]
        plan = None
        vllm = engine.gpu_memory_utilization
        for g in counts:
            room = usable_bytes(pool, g, vllm)
            if need <= room:  # vLLM gives KV all of its share that weights and activations leave
                kv_tokens = int((room - weights - adapters) * (1.0 if vllm else engine.kv_memory_fraction)) // per_token
                plan = PlacementPlan(pool.name, g, kv_tokens, per_token, weights, pool.gpu_product, adapters)
                fits.append((g * pool.gpu_memory_bytes, g, pool.name, plan))
                break
        if plan is None:
            most = max(counts, default=0)
            room = usable_bytes(pool, most, vllm) if most else 0
            lora = (
                f" + LoRA {adapters / GiB:.1f} for {engine.lora_slots} slots and {engine.lora_loaded} adapters "
                f"at rank {engine.lora_rank}"
                if adapters
                else ""
            )
            reasons.append(
                f"pool {pool.name}: needs {need / GiB:.1f} GiB (weights {weights / GiB:.1f} + KV {kv_needed / GiB:.1f} "
                f"for {engine.max_num_seqs} x {engine.max_model_len} tokens{lora}) but {most or 'no'} GPU(s) of "
                f"{pool.gpu_memory_bytes / GiB:.0f} GiB give {room / GiB:.1f} GiB usable"
            )
    if fits:
        return min(fits, key=lambda f: f[:3])[3]
    return reasons or ["no node pools"]


def _unusable(pool: Pool, gpu_type: str | None) -> str | None:
    if pool.gpus_per_node < 1 or pool.gpu_memory_bytes <= 0:
        return "no GPUs (allocatable nvidia.com/gpu and the nvidia.com/gpu.memory label are missing)"
    if gpu_type and (pool.gpu_product is None or gpu_type.lower() not in pool.gpu_product.lower()):
        return f"GPU {pool.gpu_product} is not the requested {gpu_type}"
    return None
