"""vLLM's KV event batches, decoded: every shape vLLM has published.

One ZMQ message is `(topic, seq as 8-byte big-endian, msgpack batch)`. The batch is
`[ts, events, data_parallel_rank]` (vllm 0.32: a positional array) or a map with those keys (some
upstream versions). Each event is a map tagged `type` (0.32) or, before vLLM PR 42892, a tagged
positional array `[type, field, ...]`. Every consumer of the second form broke when the first
arrived; both levels are read in both forms here. Fixtures: tests/fixtures/vllm_kv_events/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

# The positional order of the array form's fields (vLLM's KVCacheEvent structs, in order).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedBatch(ValueError):
    """A message that is not a vLLM KV event batch; the bridge counts it and goes on."""


@dataclass(frozen=True)
class VllmStored:
    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # per block: the LoRA name, mm keys, the cache salt (block 0)


@dataclass(frozen=True)
class VllmRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class VllmCleared:
    pass


VllmEvent = VllmStored | VllmRemoved | VllmCleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[VllmEvent, ...]
    unknown: int = 0  # events of types this bridge does not know (skipped, counted)


def split_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of one message. SGLang and older vLLM send no topic frame."""
    if len(frames) == 3:
        topic, seq, payload = frames
    elif len(frames) == 2:
        (seq, payload), topic = frames, b""
    else:
        raise MalformedBatch(f"a KV event message has 2 or 3 frames, not {len(frames)}")
    if len(seq) != 8:
        raise MalformedBatch(f"the sequence frame is 8 bytes, not {len(seq)}")
    return topic, int.from_bytes(seq, "big", signed=True), payload


def decode_batch(payload: bytes) -> Batch:
    """The batch in `payload`; raises MalformedBatch saying what is wrong."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise MalformedBatch(f"a batch is [ts, events, rank] or a map of them, not {type(raw).__name__}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise MalformedBatch("a batch needs a numeric ts and a list of events")
    decoded = [_event(e) for e in events]
    known = tuple(e for e in decoded if e is not None)
    return Batch(float(ts), known, unknown=len(decoded) - len(known))


def _event(raw: Any) -> VllmEvent | None:
    if isinstance(raw, dict):
        kind, body = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(kind, ())
        body = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedBatch(f"an event is a tagged map or a tagged array, not {type(raw).__name__}")
    if kind == "BlockStored":
        return _stored(body)
    if kind == "BlockRemoved":
        return VllmRemoved(_hashes(body.get("block_hashes")))
    if kind == "AllBlocksCleared":
        return VllmCleared()
    return None  # a newer event type: skipped, counted


def _stored(body: dict) -> VllmStored:
    hashes, tokens, size = _hashes(body.get("block_hashes")), body.get("token_ids"), body.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise MalformedBatch(f"BlockStored needs a block_size >= 1, got {size!r}")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise MalformedBatch("BlockStored needs token_ids: non-negative integers")
    if len(tokens) != len(hashes) * size:
        raise MalformedBatch(f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    parent = body.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int):
        raise MalformedBatch(f"parent_block_hash must be an integer or null, got {type(parent).__name__}")
    keys = body.get("extra_keys")
    lora = body.get("lora_name")
    return VllmStored(hashes, parent, tuple(tokens), size, lora if isinstance(lora, str) else None,
                      tuple(keys) if isinstance(keys, list) else None)  # fmt: skip


def _hashes(value: Any) -> tuple[int, ...]:
    # vLLM publishes its block hashes as 64-bit integers (bytes in some builds: kept as keys too).
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise MalformedBatch("block_hashes must be a list of integers")
    return tuple(value)
