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
    server: OperatorServerConfig = field(default_factory=OperatorServerConfig)
