"""Redis key names that several parts share, with the hash tags that keep each script on one
Redis Cluster slot. Engines write the stream and lease keys; the KV cache service and the
gateway read them.

    kvharbor:kv:{M:I}                     KV event stream of one engine instance I of model M (XADD)
    kvharbor:kv:streams                   HASH stream key -> "M\\nI": every engine's stream (engines register)
    kvharbor:kv:resync                    a counter: engines re-publish everything when it moves
    kvharbor:lease:{M:I}                  the engine's lease id; PX ttl, refreshed by its heartbeat
    kvharbor:idx:{M:I}:...                the index's keys of one instance (kvcache_service/redis_index.py)
    kvharbor:idx:{M:<tier><shard>}:b2     the index's block -> holders shards (layout 2)
    kvharbor:idx:{M}:holders              the index's holder id -> instance and lease, per model
    kvharbor:blk:{s<shard>}:...           the shared KV block store (kvcache_service/block_store.py)
    kvharbor:rl:{T}:rpm|tpm|conc          one tenant's rate limits and slots (gateway/limits.py)
    kvharbor:reuse:M                      prefix-reuse counters (kvcache_service/reuse_stats.py)
    kvharbor:resp:{T}:r:<id>|idx|sz|bytes|seq|gone:<id>
                                          one tenant's stored Responses (gateway/response_store.py)

Why these tags: everything about one engine instance (its stream, lease, cursor, the blocks it
holds, the intake owner of its stream) shares the slot of `{M:I}`, so applying its events is one
atomic script that checks its lease and moves its cursor. Block-level keys are spread by block
hash over a fixed number of shards, so a lookup touches a bounded set of slots whatever the
number of engines. An instance is alive while its lease key holds the lease its events carry.
"""

from __future__ import annotations

STREAM_PREFIX = "kvharbor:kv:"
LEASE_PREFIX = "kvharbor:lease:"
INDEX_PREFIX = "kvharbor:idx:"
STORE_PREFIX = "kvharbor:blk:"
REUSE_PREFIX = "kvharbor:reuse:"
RATE_LIMIT_PREFIX = "kvharbor:rl:"
RESPONSE_PREFIX = "kvharbor:resp:"


def tag(*parts: str) -> str:
    """A hash tag: Redis Cluster places a key by the text between its first `{` and the next `}`."""
    return "{" + ":".join(parts) + "}"


def instance_tag(model: str, instance: str) -> str:
    return tag(model, instance)


def stream_key(model: str, instance: str, prefix: str = STREAM_PREFIX) -> str:
    return prefix + instance_tag(model, instance)


def stream_registry_key(prefix: str = STREAM_PREFIX) -> str:
    return prefix + "streams"


def resync_key(prefix: str = STREAM_PREFIX) -> str:
    """Bumped by the KV cache service when part of the index was lost (a cluster node restarted
    empty): every engine sees it move on its next heartbeat and re-publishes what it holds."""
    return prefix + "resync"


def registry_value(model: str, instance: str) -> str:
    return f"{model}\n{instance}"


def parse_registry_value(value: bytes | str) -> tuple[str, str]:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    model, sep, instance = text.partition("\n")
    if not sep:
        raise ValueError(f"not a stream registry entry (model, newline, instance): {text!r}")
    return model, instance


def lease_key(model: str, instance: str, prefix: str = LEASE_PREFIX) -> str:
    return prefix + instance_tag(model, instance)


def index_instance_key(model: str, instance: str, part: str, prefix: str = INDEX_PREFIX) -> str:
    return f"{prefix}{instance_tag(model, instance)}:{part}"


def index_shard_key(model: str, tier_letter: str, shard: int, prefix: str = INDEX_PREFIX) -> str:
    return f"{prefix}{tag(model, f'{tier_letter}{shard:02d}')}:b2"


def index_model_key(model: str, part: str, prefix: str = INDEX_PREFIX) -> str:
    return f"{prefix}{tag(model)}:{part}"


def store_shard_tag(shard: int) -> str:
    return tag(f"s{shard:02d}")


def rate_limit_key(tenant: str, kind: str, prefix: str = RATE_LIMIT_PREFIX) -> str:
    return f"{prefix}{tag(tenant)}:{kind}"


def response_key(tenant: str, part: str, prefix: str = RESPONSE_PREFIX) -> str:
    """A key of one tenant's stored responses: every one shares the tenant's slot, so the store's
    write (the record, its index and the tenant's byte count) is one script."""
    return f"{prefix}{tag(tenant)}:{part}"
