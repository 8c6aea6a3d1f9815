"""The KV index contract: which engine instance holds which run of a prompt's blocks.

Two backends implement `Index`: `MemoryIndex` (one process) and `RedisIndex` (shared by every
gateway and KV cache service replica). tests/test_kvindex_conformance.py runs one suite on both.

Semantics both backends keep:
- `apply` takes KV events in stream order. An event whose lease differs from the lease last seen
  for its instance starts a new life of that instance: what the old lease held is dropped first.
- Events that carry a stream position (`StreamEvent`) are applied at most once per stream: a
  position at or before the stream's applied cursor is skipped. With the Redis backend the cursor
  moves in the same atomic script as the index, so a consumer that dies between applying and
  acknowledging does not apply twice when the entries are delivered again.
- An instance is alive while its lease is current (`renew`, or the engine's own lease key in
  Redis). Lookups only count alive instances; `expire` sweeps the rest out of the index.
- `lookup` answers, for every alive instance of the model (or of `instances`) that holds the
  chain's block 0, how many blocks it holds consecutively from there. Instances that hold none
  are absent (callers read a missing instance as 0): naming every instance would make a lookup
  cost grow with the fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvharbor.common.block_hash import DIGEST_SIZE, BlockHash
from kvharbor.common.kv_events import EventEnvelope, Tier

FORGET_TTL_S = 3600.0  # longer than any event can wait in a stream before it is consumed
FORGOTTEN = "forgotten"  # the lease a forgotten instance holds: no event carries it


def joined_chain(block_hashes: Sequence[BlockHash]) -> bytes:
    """The chain's hashes as one string; ValueError unless each is DIGEST_SIZE bytes (a lookup
    of another hash could never match, and the Redis script reads the string 16 bytes at a time)."""
    if set(map(len, block_hashes)) - {DIGEST_SIZE}:  # not a generator: this runs for every lookup
        raise ValueError(f"block hashes are {DIGEST_SIZE} bytes each (common/block_hash.py)")
    return b"".join(block_hashes)


class IndexUnavailable(RuntimeError):
    """The index cannot answer now (Redis down or too slow). Callers fall back to load-only routing."""


class LeadershipLost(RuntimeError):
    """A fenced apply found streams owned by another consumer: their events were not applied
    (`lost`: the (model, instance) pairs); the other instances' were (`applied` of them)."""

    def __init__(self, message: str, lost: frozenset[tuple[str, str]] = frozenset(), applied: int = 0) -> None:
        super().__init__(message)
        self.lost = lost
        self.applied = applied


@dataclass(frozen=True)
class StreamEvent:
    """An event and where it sits in its Redis Stream, for exactly-once application."""

    envelope: EventEnvelope
    stream: str
    entry_id: str


@dataclass(frozen=True)
class InstanceInfo:
    model: str
    instance: str
    lease: str
    alive: bool
    blocks: int  # device-tier blocks indexed for this instance


def stream_position(entry_id: str) -> tuple[int, int]:
    """Order of a Redis Stream entry id `<ms>-<seq>`."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"not a Redis Stream entry id: {entry_id!r}") from None


class Index(Protocol):
    async def apply(self, events: Sequence[EventEnvelope | StreamEvent], fence: str | None = None) -> int:
        """Apply events in order; returns how many were applied (not skipped as already applied).

        `fence`: the intake consumer's name. Each instance's events apply only while the owner key
        of its stream names that consumer, atomically with the check (LeadershipLost otherwise).
        Backends without shared ownership ignore it."""

    async def lookup(
        self,
        model: str,
        block_hashes: Sequence[BlockHash],
        instances: Sequence[str] | None = None,
        tier: Tier = "device",
    ) -> dict[str, int]:
        """For each alive instance holding block 0: blocks held consecutively from it."""

    async def renew(self, model: str, instance: str, lease: str, ttl: float) -> None:
        """Keep `instance` alive under `lease` for `ttl` seconds."""

    async def instances(self) -> list[InstanceInfo]: ...

    async def expire(self) -> list[tuple[str, str]]:
        """Sweep instances whose lease lapsed; returns the (model, instance) pairs swept."""

    async def forget(self, model: str, instances: Sequence[str], ttl: float = FORGET_TTL_S) -> int:
        """Drop instances that are gone for good (their InferenceService was deleted): their
        entries go now, and for `ttl` seconds their events still in the stream are ignored rather
        than bringing them back. Returns how many were registered."""

    async def block_size(self, model: str) -> int | None:
        """The block size the model's engines publish with, once any `stored` event was seen."""

    async def close(self) -> None: ...
