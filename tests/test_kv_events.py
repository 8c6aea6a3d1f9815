"""KV event wire format: round trips, and malformed entries raise MalformedEvent only."""

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.kv_events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventEnvelope,
    MalformedEvent,
    from_fields,
    to_fields,
)

HASHES = tuple(block_hashes(list(range(64)), 16, "m"))


@pytest.mark.parametrize(
    "event",
    [
        BlockStored(hashes=HASHES[1:], parent=HASHES[0], block_size=16),
        BlockStored(hashes=HASHES, parent=None, block_size=16, tier="shared"),
        BlockRemoved(hashes=HASHES[:2]),
        AllCleared(),
    ],
)
def test_round_trip(event):
    env = EventEnvelope(event=event, instance="engine-0", model="m", lease="lease-1", seq=7)
    fields = to_fields(env)
    assert all(isinstance(v, str) for v in fields.values())
    # Redis hands fields back as bytes.
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    assert from_fields(raw) == env
    assert from_fields([x for kv in raw.items() for x in kv]) == env  # a raw reply's flat list


def _good_fields():
    env = EventEnvelope(BlockStored(hashes=HASHES[:1], parent=None, block_size=16), "i", "m", "l", 1)
    return to_fields(env)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda f: f.pop("type"),
        lambda f: f.update(type="exploded"),
        lambda f: f.update(v="99"),
        lambda f: f.update(v="one"),
        lambda f: f.update(body="{not json"),
        lambda f: f.update(body="[]"),
        lambda f: f.update(body=json.dumps({"hashes": ["abcd"], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": [], "parent": None, "block_size": 16})),
        # One hash or several, each must be exactly 32 hex digits (fromhex would skip spaces).
        lambda f: f.update(body=json.dumps({"hashes": ["ab " * 15 + "ab"], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": ["zz" * 16], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": [HASHES[0].hex(), "ab"], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": [HASHES[0].hex(), 7], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": [12], "parent": None, "block_size": 16})),
        lambda f: f.update(body=json.dumps({"hashes": [HASHES[0].hex()], "parent": None, "block_size": 0})),
        lambda f: f.update(body=json.dumps({"hashes": [HASHES[0].hex()], "block_size": 16, "tier": "moon"})),
        lambda f: f.update(seq="x"),
        lambda f: f.update(body=b"\xff\xfe"),
    ],
)
def test_malformed_entries_raise_malformed_event(mutate):
    fields = _good_fields()
    mutate(fields)
    with pytest.raises(MalformedEvent):
        from_fields(fields)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "type", "instance", "model", "lease", "seq", "body", "x"]),
        st.one_of(st.text(max_size=40), st.binary(max_size=40)),
    )
)
def test_fuzzed_entries_never_raise_anything_else(fields):
    with contextlib.suppress(MalformedEvent):
        from_fields([x for kv in fields.items() for x in kv])  # as a raw reply's flat list
    with contextlib.suppress(MalformedEvent):
        from_fields(fields)
