"""`kvharbor gateway` configuration: flags, KVHARBOR_* variables or a YAML file, with the same names.

One model is configured with flags (`--engines`, `--model`, `--served-model-name`, the SLOs);
several with `--models-file` (see gateway/README.md). Names shared with other parts (redis_url,
host, port, log_*, max_body_bytes) mean the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvharbor.common.config import opt
from kvharbor.common.request_limits import RequestLimits
from kvharbor.common.server_config import TracedListenConfig


@dataclass(frozen=True)
class ServingConfig:
    engines: str = opt("", "comma-separated engine URLs of the model (static discovery)")
    model: str | None = opt(None, "the model's files, for its tokenizer: .gguf or HF folder (default: bundled SmolLM2)")
    served_model_name: str | None = opt(None, "the model id clients and engines use (default: from the files)")
    models_file: str | None = opt(None, "YAML file of models, their files, engines and SLOs (instead of --engines)")
    slo_ttft_ms: float = opt(2000.0, "TTFT p95 target (ms): admission queues or sheds beyond it")
    slo_itl_ms: float = opt(200.0, "inter-token latency p95 target (ms), for goodput")
    discovery: Literal["static", "kubernetes"] = opt(
        "static", "where engine URLs come from: static (--engines / models file) or kubernetes (EndpointSlices)"
    )
    discovery_namespace: str | None = opt(None, "namespace of the engine Services (default: the gateway pod's own)")
    discovery_interval: float = opt(5.0, "seconds between reads of the engine Services and EndpointSlices")
    vllm_priority: bool = opt(
        False, "vLLM engines run --scheduling-policy priority (the operator's do): send them each tenant's priority "
        "(negated: vLLM runs lower values first); off: none (vLLM refuses one under its default fcfs)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.slo_ttft_ms <= 0 or self.slo_itl_ms <= 0:
            raise ValueError("slo_ttft_ms and slo_itl_ms must be > 0")
        if self.discovery_interval <= 0:
            raise ValueError("discovery_interval must be > 0")


@dataclass(frozen=True)
class TenancyConfig:
    tenants_file: str | None = opt(None, "YAML file of tenants and their hashed API keys (hot-reloaded)")
    redis_url: str | None = opt(
        None,
        "Redis for shared rate limits and the KV index: redis://host:port/db, or redis+cluster://host:port "
        "for a Redis Cluster",
    )
    limits_on_redis_failure: Literal["open", "closed"] = opt(
        "open", "when Redis is down: open (local buckets per gateway) or closed (503)"
    )

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            from kvharbor.common.redis_client import check_url

            check_url(self.redis_url)  # a ValueError that says which URLs are accepted


@dataclass(frozen=True)
class ResponseStoreConfig:
    """The Responses API's stored conversations (gateway/response_store.py): in Redis with
    --redis-url (every replica shares them), else in this process."""

    # OpenAI keeps stored responses 30 days.
    response_store_ttl: float = opt(2_592_000.0, "seconds a stored response is kept after it is written")
    response_store_budget_bytes: int = opt(
        64 * 2**20, "bytes of stored responses each tenant may hold; past it the least recently written go first"
    )

    def __post_init__(self) -> None:
        if not self.response_store_ttl > 0:
            raise ValueError(f"response_store_ttl must be > 0 seconds, got {self.response_store_ttl}")
        if self.response_store_budget_bytes < 1:
            raise ValueError(f"response_store_budget_bytes must be >= 1, got {self.response_store_budget_bytes}")


@dataclass(frozen=True)
class RoutingConfig:
    routing: Literal["prefix", "round_robin", "least_loaded"] = opt("prefix", "how to pick an engine")
    prefix_weight: float = opt(2.0, "weight of the prefix score (matched blocks / prompt blocks)")
    kv_weight: float = opt(1.0, "weight of the free-KV score")
    queue_weight: float = opt(1.0, "weight of the short-queue score")
    imbalance_threshold: int = opt(8, "queue-length gap between engines beyond which routing looks at load only")
    index_timeout: float = opt(0.2, "seconds a KV index lookup may take before routing falls back to load")
    load_interval: float = opt(0.5, "seconds between /load polls of each engine")
    disaggregation: Literal["auto", "off"] = opt(
        "auto", "P/D: auto (prefill on a role-prefill engine when the predicted gain pays for the KV transfer), off"
    )
    pd_min_gain_ms: float = opt(
        50.0, "P/D: decode-engine prefill time a hand-off must spare, net of its transfer, to be worth it (ms)"
    )
    pd_transfer_trust_s: float = opt(
        10.0,
        "P/D: seconds a decode engine's measured KV pull rate is trusted as it is; past that it counts as "
        "2^(age/trust - 1) times as fast, up to the 500 MB/s assumed before any pull, until a hand-off measures it "
        "again (0: trust it for good)",
    )
    pd_prefill_deadline_s: float = opt(
        10.0,
        "P/D: the least time a prefill engine gets for a prompt before the gateway prefills it on the decode "
        "engine instead, counting a failure against the prefill engine; the deadline is the larger of this and 4x "
        "the predicted TTFT",
    )

    def __post_init__(self) -> None:
        if min(self.prefix_weight, self.kv_weight, self.queue_weight) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.pd_min_gain_ms < 0:
            raise ValueError(f"pd_min_gain_ms must be >= 0, got {self.pd_min_gain_ms}")
        if not self.pd_transfer_trust_s >= 0:  # NaN too
            raise ValueError(f"pd_transfer_trust_s must be >= 0 (0: trust a measured rate for good), got "
                             f"{self.pd_transfer_trust_s}")  # fmt: skip
        if not self.pd_prefill_deadline_s > 0:  # NaN too
            raise ValueError(f"pd_prefill_deadline_s must be > 0 seconds, got {self.pd_prefill_deadline_s}")
        if self.imbalance_threshold < 1:
            raise ValueError(f"imbalance_threshold must be >= 1, got {self.imbalance_threshold}")


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue: int = opt(256, "requests that may wait in the gateway for an engine that meets the SLO")
    queue_timeout: float = opt(30.0, "seconds a queued request waits before it gets 503")

    def __post_init__(self) -> None:
        if self.max_queue < 0 or self.queue_timeout <= 0:
            raise ValueError("max_queue must be >= 0 and queue_timeout > 0")


@dataclass(frozen=True)
class ResilienceConfig:
    connect_timeout: float = opt(2.0, "seconds to connect to an engine")
    first_token_timeout: float = opt(120.0, "seconds an engine may take to start answering")
    request_timeout: float = opt(600.0, "seconds one request may take in all")
    stream_deadline: float = opt(
        1800.0, "seconds a streamed answer may run in all; then it ends with an error event and the engine aborts it"
    )
    stream_idle_timeout: float = opt(
        60.0, "seconds a stream may go without a token after its first; then it ends as at its deadline"
    )
    max_attempts: int = opt(3, "engines tried for one request before it fails (only before its first token)")
    max_migrations: int = opt(
        2, "times one stream may move to another engine when its engine fails mid-way (0: the stream ends instead)"
    )
    eject_after_failures: int = opt(3, "consecutive failures that eject an engine until it is healthy again")
    # NOTE: 30, not 10: on a loaded 2-core machine an engine's API server (at a lower CPU priority
    # than its core) left /load unanswered for over 10 s while its core prefilled 2,400 tokens.
    engine_stall_timeout: float = opt(
        30.0, "seconds an engine may go without answering /load, or answer with its core silent or its steps "
        "still while it has requests, before it counts as stalled: ejected, and the requests waiting on it for "
        "their first token moved (a busy engine answers /load late; it is not ejected for that)",
    )  # fmt: skip
    max_body_bytes: int = opt(4_000_000, "largest accepted request body (413 above)")
    max_prompt_tokens: int = opt(32768, "longest accepted prompt, in tokens (400 above)")

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.eject_after_failures < 1:
            raise ValueError("max_attempts and eject_after_failures must be >= 1")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.engine_stall_timeout > 0:
            raise ValueError(f"engine_stall_timeout must be > 0 seconds, got {self.engine_stall_timeout}")
        if self.stream_deadline <= 0 or self.stream_idle_timeout <= 0:
            raise ValueError("stream_deadline and stream_idle_timeout must be > 0 seconds")


@dataclass(frozen=True)
class GatewayServerConfig(TracedListenConfig):
    # Always a port of its own: /metrics names every tenant, and tenants reach --port.
    admin_port: int | None = opt(9090, "TCP port of the admin listener (/metrics): never the tenants' --port")
    # Within Kubernetes' default 30 s grace period: a pod that drains longer is SIGKILLed anyway.
    drain_timeout: float = opt(
        25.0, "seconds SIGTERM lets open streams finish (new connections are refused) before closing them"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.admin_port is None:
            raise ValueError("admin_port is required for the gateway: /metrics must not be on the tenants' port")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")


@dataclass(frozen=True)
class GatewayConfig:
    """`kvharbor gateway`: the tenants' OpenAI API in front of the engines."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    responses: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    server: GatewayServerConfig = field(default_factory=GatewayServerConfig)
