"""`kvharbor operator` configuration: flags, KVHARBOR_* variables or a YAML file, with the same names.

Names shared with other parts (redis_url, log_level, log_json) mean the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvharbor.common.config import opt
from kvharbor.common.server_config import ListenConfig
from kvharbor.operator.placement import POOL_LABEL


@dataclass(frozen=True)
class WatchConfig:
    namespaces: str = opt("", "comma-separated namespaces to watch (default: all namespaces)")
    pool_label: str = opt(POOL_LABEL, "node label that groups GPU nodes into pools")
    interval: float = opt(15.0, "seconds between status/scaling passes over each InferenceService")
    load_timeout: float = opt(2.0, "seconds an engine's /load may take before it counts as unanswered")

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.load_timeout <= 0:
            raise ValueError("interval and load_timeout must be > 0")

    def namespace_list(self) -> list[str]:
        return [n.strip() for n in self.namespaces.split(",") if n.strip()]


@dataclass(frozen=True)
class EngineDefaults:
    engine_image: str = opt("ghcr.io/kvharbor/engine:0.1.0", "container image of the engine pods")
    redis_url: str | None = opt(None, "Redis of the KV index: engines publish to it, deletion clears it")
    engine_redis_secret: str | None = opt(
        None, "Secret (in the engines' namespace) whose key engine_redis_secret_key holds the engines' Redis URL: "
        "engine pods get KVHARBOR_REDIS_URL from it, and redis_url stays out of their ConfigMap",
    )  # fmt: skip
    engine_redis_secret_key: str = opt("url", "key of engine_redis_secret that holds the URL")
    vllm_image: str = opt(
        "vllm/vllm-openai:v0.32.0", "container image of vLLM pods (engine.kind: vllm) unless a spec names its own"
    )


@dataclass(frozen=True)
class ScalingConfig:
    scale_up_cooldown: float = opt(30.0, "seconds after a change before scaling up again")
    scale_down_cooldown: float = opt(300.0, "seconds after a change before scaling down again")

    def __post_init__(self) -> None:
        if self.scale_up_cooldown < 0 or self.scale_down_cooldown < 0:
            raise ValueError("cool-downs must be >= 0")


@dataclass(frozen=True)
class TenantsConfig:
    tenants_secret: str = opt("kvharbor-gateway-tenants", "Secret the gateway reads its tenants file from")
    tenants_namespace: str = opt("kvharbor", "namespace of that Secret (the chart's release namespace)")


@dataclass(frozen=True)
class LeaderConfig:
    """Leader election on a coordination.k8s.io/v1 Lease (operator/leader.py), as client-go's does."""

    leader_election: bool = opt(True, "act only while holding the Lease, so that one of several replicas acts")
    lease_name: str = opt("kvharbor-operator", "name of the Lease the replicas elect their leader on")
    lease_namespace: str = opt("", "namespace of that Lease (empty: tenants_namespace, the release namespace)")
    lease_duration: int = opt(15, "whole seconds a standby waits, after the Lease last changed, before taking over")
    renew_deadline: float = opt(10.0, "seconds a leader keeps acting without a renewal before it stops (and exits 1)")
    retry_interval: float = opt(2.0, "seconds between a leader's renewals and between a standby's attempts")

    def __post_init__(self) -> None:
        if not self.lease_name:
            raise ValueError("lease_name must not be empty")
        if self.lease_duration < 1:
            raise ValueError(f"lease_duration must be at least 1 second, not {self.lease_duration}")
        if not 0 < self.retry_interval < self.renew_deadline:
            raise ValueError(
                f"retry_interval ({self.retry_interval:g} s) must be > 0 and shorter than renew_deadline "
                f"({self.renew_deadline:g} s): a leader renews several times before it gives up"
            )
        if self.renew_deadline >= self.lease_duration:
            raise ValueError(
                f"renew_deadline ({self.renew_deadline:g} s) must be shorter than lease_duration "
                f"({self.lease_duration} s): a leader must stop acting before a standby may take over"
            )


@dataclass(frozen=True)
class OperatorServerConfig(ListenConfig):
    host: str = opt("127.0.0.1", "address of the /healthz liveness endpoint (0.0.0.0 in a pod)")
    port: int = opt(8080, "port of the /healthz liveness endpoint (0: none)")

    PORT_MAY_BE_ZERO: ClassVar[bool] = True


@dataclass(frozen=True)
class OperatorConfig:
    """`kvharbor operator`: reconcile InferenceService and Tenant resources (kopf)."""

    watch: WatchConfig = field(default_factory=WatchConfig)
    engine: EngineDefaults = field(default_factory=EngineDefaults)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    leader: LeaderConfig = field(default_factory=LeaderConfig)
    server: OperatorServerConfig = field(default_factory=OperatorServerConfig)
