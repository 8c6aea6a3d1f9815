"""The server sub-config every command shares: where it listens, how it logs, where it sends traces.

Each part's own server config subclasses one of these and changes only its default port and
adds its own fields, so `--host`, `--port`, `--admin-port`, `--header-timeout`, `--log-level`,
`--log-json` and `--otlp-endpoint` mean the same thing, with the same checks, on every command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvharbor.common.config import opt
from kvharbor.common.http_server import HEADER_TIMEOUT_S


@dataclass(frozen=True)
class ListenConfig:
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "TCP port to listen on")
    log_level: Literal["debug", "info", "warning", "error"] = opt("info", "log level")
    log_json: bool = opt(True, "log one JSON object per line")

    # A part whose listener is optional (the operator's /healthz) sets this to allow port 0.
    PORT_MAY_BE_ZERO: ClassVar[bool] = False

    def __post_init__(self) -> None:
        low = 0 if self.PORT_MAY_BE_ZERO else 1
        if not low <= self.port < 65536:
            raise ValueError(f"port must be in {low}..65535, got {self.port}")


@dataclass(frozen=True)
class ServiceListenConfig(ListenConfig):
    """A part with operator-facing endpoints (metrics, admin calls) that can move to their own port."""

    admin_port: int | None = opt(
        None, "TCP port of the admin listener: /metrics and operator-facing endpoints (default: none, all on --port)"
    )
    header_timeout: float = opt(
        HEADER_TIMEOUT_S, "seconds a client has to send a request's headers, from connecting or from its last response"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.header_timeout <= 3600:
            raise ValueError(f"header_timeout must be in (0, 3600] seconds, got {self.header_timeout}")
        if self.admin_port is None:
            return
        if not 1 <= self.admin_port < 65536:
            raise ValueError(f"admin_port must be in 1..65535, got {self.admin_port}")
        if self.admin_port == self.port:
            raise ValueError(f"admin_port must differ from port ({self.port}): admin endpoints are kept off it")


@dataclass(frozen=True)
class TracedListenConfig(ServiceListenConfig):
    otlp_endpoint: str | None = opt(None, "OTLP/HTTP endpoint for traces, e.g. http://collector:4318/v1/traces")
