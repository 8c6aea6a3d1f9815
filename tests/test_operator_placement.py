"""Operator pure functions: placement over node pools, and scaling decisions."""

from __future__ import annotations

import pytest

from kvharbor.common.load_report import LoadReport
from kvharbor.operator.model_profiles import KNOWN, ModelProfile, profile_for
from kvharbor.operator.placement import EngineShape, PlacementPlan, Pool, place, pools_from_nodes
from kvharbor.operator.scaling import AutoscalingSpec, observed, scale_decision

MiB = 1 << 20


def node(name: str, pool: str, gpus: int | None, product: str | None = None, memory_mib: int | None = None) -> dict:
    labels = {"kvharbor.io/pool": pool}
    if product:
        labels |= {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(memory_mib)}
    allocatable = {"cpu": "16", "memory": "64Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": allocatable}}  # fmt: skip


NODES = (
    [node(f"h100-{i}", "h100", 8, "NVIDIA-H100-80GB-HBM3", 81559) for i in range(2)]
    + [node(f"l4-{i}", "l4", 4, "NVIDIA-L4", 23034) for i in range(3)]
    + [node(f"cpu-{i}", "cpu", None) for i in range(2)]
)
POOLS = pools_from_nodes(NODES)


def shape(seqs: int, length: int, dtype: str = "bfloat16") -> EngineShape:
    return EngineShape(dtype=dtype, max_model_len=length, max_num_seqs=seqs)


def test_pools_from_nodes():
    by_name = {p.name: p for p in POOLS}
    assert by_name["h100"] == Pool("h100", "NVIDIA-H100-80GB-HBM3", 81559 * MiB, 8, 2)
    assert by_name["l4"].gpus_per_node == 4 and by_name["l4"].nodes == 3
    assert by_name["cpu"].gpus_per_node == 0


@pytest.mark.parametrize(
    ("model", "seqs", "length", "pool", "gpus"),
    [
        ("SmolLM2-135M-Instruct", 64, 8192, "l4", 1),  # tiny: the smallest GPU
        ("Llama-3.1-8B-Instruct", 16, 8192, "l4", 2),  # 15 GiB weights + 16 GiB KV
        ("Llama-3.1-8B-Instruct", 64, 8192, "l4", 4),  # + 64 GiB KV: four L4s beat two H100s on memory
        ("Llama-3.1-70B-Instruct", 16, 8192, "h100", 4),  # 131 GiB weights + 40 GiB KV
        ("Llama-3.1-70B-Instruct", 1, 4096, "h100", 2),
    ],
)
def test_placement_picks_the_smallest_fit(model, seqs, length, pool, gpus):
    plan = place(KNOWN[model], shape(seqs, length), POOLS)
    assert isinstance(plan, PlacementPlan), plan
    assert (plan.pool, plan.gpus_per_replica) == (pool, gpus)
    assert plan.kv_capacity_tokens >= seqs * length


def test_kv_capacity_by_hand():
    plan = place(KNOWN["SmolLM2-135M-Instruct"], shape(8, 2048), POOLS)
    per_token = 2 * 30 * 3 * 64 * 2  # K and V x layers x kv heads x head dim x bf16 bytes = 23,040
    gpu = 23034 * MiB
    usable = gpu - int(gpu * 0.10)  # headroom: 10% of the GPU (more than the 1 GiB minimum)
    weights = 134_515_008 * 2
    assert plan.bytes_per_token == per_token == 23_040
    assert plan.kv_capacity_tokens == (usable - weights) // per_token == 931_795


def test_quantized_weights_are_placed_at_their_quantized_size():
    smol = KNOWN["SmolLM2-135M-Instruct"]
    rest = 134_515_008 - 106_168_320  # the embedding (tied) and the norms stay at the dtype
    assert smol.weight_bytes("float32", "int8") == int(106_168_320 * (1 + 4 / 512)) + rest * 4
    assert smol.weight_bytes("bfloat16", "int4") == int(106_168_320 * 24 / 32) + rest * 2
    assert smol.weight_bytes("bfloat16", "gguf", gguf_bits=4) == smol.weight_bytes("bfloat16", "int4")
    # unless told the file is 4-bit, gguf is placed at Q8_0's 36 bytes per 32 (never under-counted)
    assert smol.weight_bytes("bfloat16", "gguf") == int(106_168_320 * 36 / 32) + rest * 2
    with pytest.raises(ValueError, match="ggufBits must be 4 or 8"):
        smol.weight_bytes("bfloat16", "gguf", gguf_bits=5)
    llama = KNOWN["Llama-3.1-70B-Instruct"]
    full = place(llama, shape(16, 8192), POOLS)
    int4 = place(llama, EngineShape("bfloat16", 8192, 16, quantization="int4"), POOLS)
    assert (full.pool, full.gpus_per_replica) == ("h100", 4)  # 131 GiB of bf16 weights + 40 GiB KV
    assert (int4.pool, int4.gpus_per_replica) == ("h100", 2)  # 52 GiB: the same fits on half the GPUs
    assert int4.weight_bytes < full.weight_bytes / 2.4
    same = place(llama, EngineShape("bfloat16", 8192, 16, quantization="int8"), POOLS, gpus_per_replica=4)
    assert same.kv_capacity_tokens > full.kv_capacity_tokens  # the bytes saved go to the KV pool


def test_an_8_bit_kv_cache_is_placed_at_its_row_size():
    smol = KNOWN["SmolLM2-135M-Instruct"]
    assert smol.kv_bytes_per_token("float32", "int8") == smol.kv_bytes_per_token("bfloat16", "fp8") == 2 * 30 * 3 * 66
    plain = place(smol, shape(8, 2048), POOLS)
    int8 = place(smol, EngineShape("bfloat16", 2048, 8, kv_cache_dtype="int8"), POOLS)
    assert int8.bytes_per_token == 11_880 and int8.kv_capacity_tokens >= 1.9 * plain.kv_capacity_tokens
    with pytest.raises(ValueError, match="one of auto, int8, fp8"):
        smol.kv_bytes_per_token("bfloat16", "int4")


def test_quantized_placement_needs_the_projections_size():
    custom = profile_for("x", {"parameters": 10**9, "layers": 2, "kvHeads": 1, "headDim": 8})
    assert custom.weight_bytes("bfloat16") == 2 * 10**9
    with pytest.raises(ValueError, match="linearParameters"):
        custom.weight_bytes("bfloat16", "int4")
    shape_of = {"parameters": 10**9, "layers": 2, "kvHeads": 1, "headDim": 8, "linearParameters": 8 * 10**8}
    sized = profile_for("x", shape_of)
    assert sized.weight_bytes("bfloat16", "int4") == 6 * 10**8 + 4 * 10**8
    with pytest.raises(ValueError, match="one of none, int8, int4, gguf"):
        sized.weight_bytes("bfloat16", "int3")


def test_no_fit_says_why_with_numbers():
    reasons = place(KNOWN["Llama-3.1-70B-Instruct"], shape(256, 32768), POOLS)
    assert isinstance(reasons, list) and len(reasons) == 3
    text = "\n".join(reasons)
    assert "pool cpu: no GPUs" in text
    assert "pool h100: needs" in text and "GiB" in text and "8 GPU(s) of 80 GiB" in text
    assert "pool l4: needs" in text


def test_pool_gpu_type_and_fixed_gpu_count_are_honoured():
    model = KNOWN["Llama-3.1-8B-Instruct"]
    plan = place(model, shape(16, 8192), POOLS, node_pool="h100")
    assert (plan.pool, plan.gpus_per_replica) == ("h100", 1)
    plan = place(model, shape(16, 8192), POOLS, gpu_type="H100", gpus_per_replica=2)
    assert (plan.pool, plan.gpus_per_replica) == ("h100", 2)
    reasons = place(model, shape(16, 8192), POOLS, node_pool="tpu")
    assert reasons == ["node pool 'tpu' does not exist; pools: cpu, h100, l4"]
    reasons = place(model, shape(16, 8192), POOLS, node_pool="l4", gpu_type="A100")
    assert "not the requested A100" in reasons[0]


def test_tensor_parallel_must_divide_the_kv_heads():
    odd = ModelProfile("odd", 80_000_000_000, 40, 3, 128)  # 3 KV heads: only 1 or 3 GPUs could split them
    reasons = place(odd, shape(1, 1024), POOLS)
    assert isinstance(reasons, list)  # 160 GB of weights need several GPUs, and 2, 4, 8 do not divide 3


def test_profiles():
    assert (
        profile_for("x", {"parameters": 10, "layers": 2, "kvHeads": 1, "headDim": 8}).kv_bytes_per_token("float32")
        == 128
    )
    with pytest.raises(ValueError, match="no known profile"):
        profile_for("unknown-model")
    with pytest.raises(ValueError, match="integer parameters"):
        profile_for("x", {"parameters": "many"})


# -- scaling ---------------------------------------------------------------------------------------

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=6, metric="queue", target=8, up_cooldown_s=30, down_cooldown_s=300)


@pytest.mark.parametrize(
    ("value", "current", "since", "want"),
    [
        (8.0, 2, 1000, 2),  # at target
        (8.6, 2, 1000, 2),  # within the 10% tolerance
        (16.0, 2, 1000, 4),  # twice the target: twice the replicas
        (40.0, 2, 1000, 6),  # capped at max
        (16.0, 2, 10, 2),  # scale-up cool-down
        (2.0, 4, 1000, 1),  # a quarter of the target
        (2.0, 4, 100, 4),  # scale-down cool-down is longer
        (None, 3, 1000, 3),  # no data: no change
        (8.0, 9, 0, 6),  # out of bounds is fixed at once
        (8.0, 0, 0, 1),
    ],
)
def test_scale_decision(value, current, since, want):
    assert scale_decision(value, SPEC, current, now=10_000.0, last_change=10_000.0 - since) == want


def test_slo_metric_scales_up_when_attainment_drops():
    spec = AutoscalingSpec(1, 10, "slo", target=0.95)
    assert scale_decision(0.5, spec, 2, now=1000, last_change=0) == 4
    assert scale_decision(0.96, spec, 2, now=1000, last_change=0) == 2


def test_observed_metrics_from_load_reports():
    loads = [
        LoadReport(running=3, waiting=5, kv_blocks_total=100, kv_blocks_free=25),
        LoadReport(running=1, waiting=1, kv_blocks_total=100, kv_blocks_free=75),
    ]
    assert observed("queue", loads) == 5.0
    assert observed("kv", loads) == 0.5
    assert observed("slo", loads) is None and observed("queue", []) is None
    with pytest.raises(ValueError, match="queue, kv, slo, prefill_tokens or itl"):
        observed("gpu", loads)


def test_prefill_and_decode_metrics_from_load_reports():
    prefill = [LoadReport(role="prefill", waiting_prefill_tokens=3000), LoadReport(role="prefill")]
    assert observed("prefill_tokens", prefill) == 1500.0
    # itl: the step each engine predicts for the batch it runs now (measured 100 ms at 8 sequences,
    # 5 ms more per sequence); an engine that measured no step yet gives no data.
    busy = LoadReport(role="decode", running=10, decode_step_ms=100.0, decode_batch=8, decode_ms_per_seq=5.0)
    idle = LoadReport(role="decode", running=0, decode_step_ms=100.0, decode_batch=8, decode_ms_per_seq=5.0)
    assert observed("itl", [busy]) == pytest.approx(110.0)
    assert observed("itl", [busy, idle]) == pytest.approx((110.0 + 60.0) / 2)
    assert observed("itl", [LoadReport(role="decode", running=3)]) is None
    spec = AutoscalingSpec(1, 8, "itl", target=120)
    assert scale_decision(240.0, spec, 2, now=1000, last_change=0) == 4  # twice the ITL SLO: twice the engines
