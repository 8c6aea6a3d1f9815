"""KV events: what an engine tells the KV index about the blocks it holds; a contract in common/.

The engine's block pool queues `BlockStored`, `BlockRemoved` and `AllCleared`; a publisher wraps
each in an `EventEnvelope` (instance id, lease, sequence number) and writes it to the Redis Stream
of its model with `to_fields`. Consumers parse with `from_fields`, which raises `MalformedEvent`
for anything they must skip and count, never crash on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from kvharbor.common.block_hash import DIGEST_SIZE, BlockHash, from_hex, to_hex

EVENT_VERSION = 1
Tier = Literal["device", "shared"]
TIERS: tuple[str, ...] = ("device", "shared")


class MalformedEvent(ValueError):
    """A stream entry that is not a valid kvharbor KV event."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks `hashes` (a chain, in order) became reusable; `parent` is the block before the first."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    block_size: int
    tier: Tier = "device"
    type: Literal["stored"] = field(default="stored", init=False)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks `hashes` can no longer be reused from this instance."""

    hashes: tuple[BlockHash, ...]
    tier: Tier = "device"
    type: Literal["removed"] = field(default="removed", init=False)


@dataclass(frozen=True)
class AllCleared:
    """The instance dropped every cached block (reset, restart, or re-sync before a full replay)."""

    type: Literal["cleared"] = field(default="cleared", init=False)


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class EventEnvelope:
    """One event as it travels: who sent it, under which lease, in which order."""

    event: KVEvent
    instance: str
    model: str
    lease: str
    seq: int
    version: int = EVENT_VERSION


def _event_body(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {
            "hashes": [to_hex(h) for h in event.hashes],
            "parent": to_hex(event.parent) if event.parent is not None else None,
            "block_size": event.block_size,
            "tier": event.tier,
        }
    if isinstance(event, BlockRemoved):
        return {"hashes": [to_hex(h) for h in event.hashes], "tier": event.tier}
    return {}


def to_fields(envelope: EventEnvelope) -> dict[str, str]:
    """Flat string fields for one Redis Stream entry (XADD)."""
    return {
        "v": str(envelope.version),
        "type": envelope.event.type,
        "instance": envelope.instance,
        "model": envelope.model,
        "lease": envelope.lease,
        "seq": str(envelope.seq),
        "body": json.dumps(_event_body(envelope.event), separators=(",", ":")),
    }


def _parse_hashes(body: dict) -> tuple[BlockHash, ...]:
    hashes = body.get("hashes")
    if not isinstance(hashes, list) or not hashes:
        raise MalformedEvent("'hashes' must be a non-empty list of hex digests")
    if len(hashes) == 1 and type(hashes[0]) is str and len(hashes[0]) == 2 * DIGEST_SIZE:  # most events
        raw = bytes.fromhex(hashes[0])  # bad hex: ValueError, so malformed
        if len(raw) != DIGEST_SIZE:  # fromhex skips spaces: count the bytes too
            raise MalformedEvent(f"every hash must be {2 * DIGEST_SIZE} hex digits")
        return (raw,)
    # One fromhex for the whole list (this runs for every event the intake reads); every item
    # must be a string of exactly one digest's hex digits.
    if set(map(type, hashes)) != {str} or set(map(len, hashes)) != {2 * DIGEST_SIZE}:
        raise MalformedEvent(f"every hash must be {2 * DIGEST_SIZE} hex digits")
    raw = bytes.fromhex("".join(hashes))
    if len(raw) != DIGEST_SIZE * len(hashes):
        raise MalformedEvent(f"every hash must be {2 * DIGEST_SIZE} hex digits")
    return tuple([raw[i : i + DIGEST_SIZE] for i in range(0, len(raw), DIGEST_SIZE)])


def _parse_tier(body: dict) -> Tier:
    tier = body.get("tier", "device")
    if tier not in TIERS:
        raise MalformedEvent(f"unknown tier {tier!r}; expected one of {TIERS}")
    return tier


def _parse_event(kind: str, body: dict) -> KVEvent:
    if kind == "stored":
        parent = body.get("parent")
        block_size = body.get("block_size")
        if not isinstance(block_size, int) or block_size < 1:
            raise MalformedEvent("'block_size' must be a positive integer")
        return BlockStored(
            hashes=_parse_hashes(body),
            parent=from_hex(parent) if parent is not None else None,
            block_size=block_size,
            tier=_parse_tier(body),
        )
    if kind == "removed":
        return BlockRemoved(hashes=_parse_hashes(body), tier=_parse_tier(body))
    if kind == "cleared":
        return AllCleared()
    raise MalformedEvent(f"unknown event type {kind!r}")


def from_fields(fields: dict | list) -> EventEnvelope:
    """Parse one stream entry (a mapping, or the flat [field, value, ...] list of a raw reply);
    raises MalformedEvent (never anything else) when it is not valid."""
    try:
        # Stream entries come as bytes from the intake: decoded here (inline: this runs for every
        # event), so one bad byte makes this entry malformed.
        if isinstance(fields, list):
            it = iter(fields)
            pairs = zip(it, it, strict=True)
        else:
            pairs = fields.items()
        f = {(k.decode() if type(k) is bytes else k): (v.decode() if type(v) is bytes else v) for k, v in pairs}
        version = int(f["v"])
        if version != EVENT_VERSION:
            raise MalformedEvent(f"unsupported event version {version} (this build reads {EVENT_VERSION})")
        body = json.loads(f["body"])
        if not isinstance(body, dict):
            raise MalformedEvent("'body' must be a JSON object")
        return EventEnvelope(
            event=_parse_event(f["type"], body),
            instance=f["instance"],
            model=f["model"],
            lease=f["lease"],
            seq=int(f["seq"]),
            version=version,
        )
    except MalformedEvent:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise MalformedEvent(f"malformed KV event: {type(exc).__name__}: {exc}") from None
