"""Prefix-reuse counters, per model, kept in Redis: engines add to them as requests finish, the KV
cache service reads them for /stats and /metrics.

A request (with at least one full prompt block) counts once, as
- `shared` (cross-instance): some of its prefix was pulled from the shared block store;
- `local`: its prefix came from the serving instance's own cache, none from the store;
- `miss`: no prompt block was reused.
Block counters split its prompt blocks the same way; bytes count what moved through the store.

On a Redis Cluster each model's hash lives on its own slot and `record` is one pipeline on it;
`read_all` finds every model's key because redis-py's cluster SCAN (redis>=5.0, both clients)
asks every primary and follows each one's cursor (tests/test_block_store.py pins that).
"""

from __future__ import annotations

from kvharbor.common.redis_keys import REUSE_PREFIX

FIELDS = (
    "requests_local",
    "requests_shared",
    "requests_miss",
    "blocks_local",
    "blocks_shared",
    "blocks_computed",
    "blocks_pushed",
    "bytes_pulled",
    "bytes_pushed",
)


def classify(prompt_blocks: int, cached_blocks: int, pulled_blocks: int) -> dict[str, int]:
    """Counter increments for one finished request. `cached_blocks` were prefix hits at admission,
    of which `pulled_blocks` had just been pulled from the store."""
    if prompt_blocks <= 0:
        return {}
    cached = min(cached_blocks, prompt_blocks)
    shared = min(pulled_blocks, cached)
    kind = "shared" if shared else ("local" if cached else "miss")
    return {
        f"requests_{kind}": 1,
        "blocks_local": cached - shared,
        "blocks_shared": shared,
        "blocks_computed": prompt_blocks - cached,
    }


async def record(client, model: str, increments: dict[str, int], prefix: str = REUSE_PREFIX) -> None:
    """Add `increments` to the model's counters (one round trip)."""
    unknown = set(increments) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown reuse counters {sorted(unknown)}; known: {FIELDS}")
    pipe = client.pipeline(transaction=False)
    for name, value in increments.items():
        if value:
            pipe.hincrby(prefix + model, name, value)
    await pipe.execute()


async def read_all(client, prefix: str = REUSE_PREFIX) -> dict[str, dict[str, int]]:
    """Every model's counters, each with all FIELDS (0 when never counted)."""
    out: dict[str, dict[str, int]] = {}
    async for key in client.scan_iter(match=prefix + "*", count=500):
        name = key.decode() if isinstance(key, bytes) else key
        raw = await client.hgetall(key)
        values = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        out[name[len(prefix) :]] = {f: values.get(f, 0) for f in FIELDS}
    return out
