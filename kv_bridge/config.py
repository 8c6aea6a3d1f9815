"""`kvharbor kv-bridge` configuration: flags, KVHARBOR_* variables or a YAML file, same names.

Names shared with `kvharbor serve` and `kvharbor kvcache` (redis_url, kv_events_stream_prefix,
lease_ttl, instance_id, block_size, host, port, log_*) mean the same thing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvharbor.common.block_hash import DEFAULT_BLOCK_SIZE
from kvharbor.common.config import opt
from kvharbor.common.redis_client import check_url
from kvharbor.common.redis_keys import STREAM_PREFIX
from kvharbor.common.server_config import ListenConfig


@dataclass(frozen=True)
class BridgeOptions:
    vllm_events: str = opt("tcp://127.0.0.1:5557", "the vLLM pod's KV event PUB endpoint (--kv-events-config endpoint)")
    vllm_replay: str | None = opt(
        "tcp://127.0.0.1:5558", "its replay ROUTER endpoint (replay_endpoint); none: gaps clear and rebuild"
    )
    vllm_topic: str = opt("", "the topic its events are published under ('' takes every topic)")
    vllm_metrics_url: str | None = opt(
        None, "the vLLM server's /metrics; the bridge's /metrics serves it after its own, so one scrape gets both"
    )
    model: str = opt("", "the served model name, as the gateway routes it (required)")
    instance_id: str = opt("", "this vLLM pod's instance id in the KV index (required; the pod name)")
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "tokens per KV block: the gateway's, and vLLM's --block-size")
    redis_url: str = opt("redis://127.0.0.1:6379/0", "Redis of the KV index (redis+cluster://host:port for a cluster)")
    kv_events_stream_prefix: str = opt(STREAM_PREFIX, "Redis key prefix of the per-instance KV event streams")
    lease_ttl: float = opt(10.0, "seconds the instance's lease lives without a heartbeat")

    def __post_init__(self) -> None:
        check_url(self.redis_url)
        if not self.model or not self.instance_id:
            raise ValueError("model and instance_id are required: the index files the pod's blocks under both")
        for name in ("vllm_events", "vllm_replay"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a ZMQ endpoint (tcp://host:port or ipc://path), got {value!r}")
        if self.vllm_metrics_url is not None and not self.vllm_metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_metrics_url must be http(s)://host:port/metrics, got {self.vllm_metrics_url!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.lease_ttl <= 1:
            raise ValueError(f"lease_ttl must be > 1 second, got {self.lease_ttl}")


@dataclass(frozen=True)
class BridgeListenConfig(ListenConfig):
    port: int = opt(8590, "TCP port of /health and /metrics")


@dataclass(frozen=True)
class KVBridgeConfig:
    server: BridgeListenConfig = field(default_factory=BridgeListenConfig)
    bridge: BridgeOptions = field(default_factory=BridgeOptions)  # (its required fields make a bare one fail)
