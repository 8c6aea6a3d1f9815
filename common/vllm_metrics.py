"""A vLLM server's Prometheus /metrics as a kvharbor LoadReport (common/load_report.py): what the
gateway routes and admits on, and the operator scales on, for vLLM pods.

vLLM's GET /load answers only {"server_load": N}; its /metrics carries the GIE model-server
protocol's signals: vllm:num_requests_running, vllm:num_requests_waiting,
vllm:kv_cache_usage_perc (0-1), vllm:cache_config_info{block_size, num_gpu_blocks} and
vllm:lora_requests_info{running_lora_adapters, max_lora}. What vLLM does not measure (prefill
rate, decode step) stays 0, which the gateway's predictions read as "not measured yet".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvharbor.common.load_report import LoadReport, LoadReportError

_SAMPLE = re.compile(r"^(?P<name>vllm:[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>[-+0-9.eE]+|NaN)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def load_from_vllm_metrics(text: str, instance_id: str) -> LoadReport:
    """The LoadReport of one vLLM server from its /metrics text. Raises LoadReportError when the
    text holds none of vLLM's serving metrics (not a vLLM server, or not serving yet)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for m in _SAMPLE.finditer(text):
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        samples.setdefault(m.group("name"), []).append((labels, float(m.group("value"))))
    if "vllm:num_requests_running" not in samples:
        raise LoadReportError("/metrics has no vllm:num_requests_running: not a vLLM server (or not serving yet)")

    def total(name: str) -> float:
        return sum(v for _, v in samples.get(name, []))

    info = dict(samples.get("vllm:cache_config_info", [({}, 0.0)])[0][0])
    blocks = int(info.get("num_gpu_blocks") or 0)
    usage = min(max(total("vllm:kv_cache_usage_perc"), 0.0), 1.0)
    model = next((labels.get("model_name", "") for labels, _ in samples["vllm:num_requests_running"]), "")
    lora = samples.get("vllm:lora_requests_info", [])
    newest = max(lora, key=lambda s: s[1])[0] if lora else {}
    adapters = [a for a in newest.get("running_lora_adapters", "").split(",") if a]
    return LoadReport(
        model=model,
        instance_id=instance_id,
        running=int(total("vllm:num_requests_running")),
        waiting=int(total("vllm:num_requests_waiting")),
        kv_blocks_total=blocks,
        kv_blocks_free=round(blocks * (1 - usage)),
        block_size=int(info.get("block_size") or 0),
        lora_adapters={a: a for a in adapters},  # vLLM names adapters; its KV events hash by the name
        lora_active=tuple(adapters),
        lora_slots=int(newest.get("max_lora") or 0),
    )


def with_vllm_adapters(load: LoadReport, models: Any) -> LoadReport:
    """`load` with every LoRA adapter vLLM's GET /v1/models lists (an entry whose `parent` is
    another model): /metrics names only those with requests running or waiting, and the gateway
    routes an adapter only to engines that report it. Raises LoadReportError for another shape."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise LoadReportError("/v1/models must answer {data: [...]} (OpenAI's list of models)")
    names = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")]
    adapters = {**load.lora_adapters, **{name: name for name in names}}  # vLLM's KV events hash by the name
    return dataclasses.replace(load, lora_adapters=adapters)
