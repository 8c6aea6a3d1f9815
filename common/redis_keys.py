"""Redis key names that several parts share: engines write them, the KV cache service and the gateway read them.

    kvharbor:kv:<model>                   KV event stream of one model (XADD by engines)
    kvharbor:lease:<model>:<instance>     an engine's lease id; PX ttl, refreshed by its heartbeat
    kvharbor:idx:...                      the KV index (kvcache_service/redis_index.py)
    kvharbor:blk:...                      the shared KV block store (kvcache_service/block_store.py)
    kvharbor:reuse:<model>                prefix-reuse counters (kvcache_service/reuse_stats.py)

An instance is alive while its lease key holds the lease its events carry.
"""

from __future__ import annotations

STREAM_PREFIX = "kvharbor:kv:"
LEASE_PREFIX = "kvharbor:lease:"
INDEX_PREFIX = "kvharbor:idx:"
STORE_PREFIX = "kvharbor:blk:"
REUSE_PREFIX = "kvharbor:reuse:"


def stream_key(model: str, prefix: str = STREAM_PREFIX) -> str:
    return prefix + model


def lease_key(model: str, instance: str, prefix: str = LEASE_PREFIX) -> str:
    return f"{prefix}{model}:{instance}"


def model_from_stream(key: str, prefix: str = STREAM_PREFIX) -> str:
    if not key.startswith(prefix):
        raise ValueError(f"{key!r} is not a KV event stream (expected prefix {prefix!r})")
    return key[len(prefix) :]
