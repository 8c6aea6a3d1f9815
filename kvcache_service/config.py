"""`kvharbor kvcache` configuration: flags, KVHARBOR_* variables or a YAML file, same names.

Names shared with `kvharbor serve` (redis_url, host, port, kv_events_stream_prefix, log_*) mean
the same thing in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvharbor.common.config import opt, parse_bytes
from kvharbor.common.redis_client import check_url
from kvharbor.common.redis_keys import STREAM_PREFIX
from kvharbor.common.server_config import ServiceListenConfig


@dataclass(frozen=True)
class IntakeConfig:
    redis_url: str = opt(
        "redis://127.0.0.1:6379/0",
        "Redis holding the engines' KV event streams, the index and the block store "
        "(redis+cluster://host:port for a Redis Cluster)",
    )
    redis_timeout: float = opt(1.0, "seconds before a Redis call counts as failed (lookups fail fast after it)")
    kv_events_stream_prefix: str = opt(
        STREAM_PREFIX, "Redis key prefix of the per-instance KV event streams (and of their registry)"
    )
    consumer_group: str = opt("kvharbor-kvcache", "Redis consumer group that the service replicas share")
    consumer_name: str | None = opt(None, "this replica's consumer name (default: hostname-pid)")
    intake_batch: int = opt(512, "stream entries read per round, per stream")
    owner_ttl: float = opt(
        10.0, "seconds a replica owns a stream (and its membership lasts) without renewal: the failover time"
    )
    rebalance_interval: float = opt(1.0, "seconds between a replica's membership heartbeats and stream rebalances")
    lease_sweep_interval: float = opt(2.0, "seconds between sweeps of instances whose lease expired")

    def __post_init__(self) -> None:
        check_url(self.redis_url)
        if self.redis_timeout <= 0:
            raise ValueError(f"redis_timeout must be > 0 seconds, got {self.redis_timeout}")
        if self.intake_batch < 1:
            raise ValueError(f"intake_batch must be >= 1, got {self.intake_batch}")
        if not 0 < self.rebalance_interval < self.owner_ttl / 3:
            raise ValueError(
                f"rebalance_interval must be > 0 and under owner_ttl / 3 ({self.owner_ttl / 3:g} s), so ownership "
                f"is renewed before it lapses; got {self.rebalance_interval}"
            )
        if self.lease_sweep_interval <= 0:
            raise ValueError(f"lease_sweep_interval must be > 0 seconds, got {self.lease_sweep_interval}")


@dataclass(frozen=True)
class StoreConfig:
    store_max_bytes: str = opt("1GiB", "byte cap of the shared KV block store (LRU beyond it), e.g. 2GiB or 500MB")

    def __post_init__(self) -> None:
        parse_bytes(self.store_max_bytes)  # raises ValueError with the accepted forms

    @property
    def cap_bytes(self) -> int:
        return parse_bytes(self.store_max_bytes)


@dataclass(frozen=True)
class ServiceServerConfig(ServiceListenConfig):
    port: int = opt(8100, "TCP port to listen on")
    max_lookup_blocks: int = opt(16384, "longest block chain one lookup may ask about (each costs Redis time)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_lookup_blocks < 1:
            raise ValueError(f"max_lookup_blocks must be >= 1, got {self.max_lookup_blocks}")


@dataclass(frozen=True)
class KVCacheServiceConfig:
    """`kvharbor kvcache`: the KV index service and the shared block store's owner."""

    intake: IntakeConfig = field(default_factory=IntakeConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServiceServerConfig = field(default_factory=ServiceServerConfig)
