"""Block hashing: pinned reference vectors, and the properties the router and engine rely on."""

import hashlib
import struct

import pytest

from kvharbor.common.block_hash import (
    block_hashes,
    extend_block_hashes,
    from_hex,
    hash_block,
    namespace_hash,
    to_hex,
)

MODEL = "SmolLM2-135M-Instruct"

# NOTE: these digests are the wire contract between engines, the KV index and the gateway.
# If this test fails, the hashing changed: that needs HASH_VERSION bumped and every part redeployed.
PINNED = {
    "ns_model": "63ef204521ee46f7068dfbdf54d4ccaa",
    "ns_model_salt": "732266966979bcb2b41d09ce094bb409",
    "chain_0_40_bs16_salt": ["a98c149c371a3a1fe051cc4971220bfd", "75f2eaa2f1ee0c620894cdfecfc8c9de"],
    "chain_1234_bs4": ["d1b97c902c267647b4338333c04a4ac6"],
    # With a LoRA adapter's identity (common/lora.py) in the namespace (issue 18).
    "ns_model_salt_adapter": "44f66d944f2aca7b23b1404d9c61e3e0",
    "chain_0_40_bs16_salt_adapter": ["826a76ec29437429dffc704e35b81fe3", "ba489d8e152ee7b9a6fe12f93dba5e74"],
}
ADAPTER = "sql@0123456789abcdef"


def test_pinned_reference_vectors():
    assert namespace_hash(MODEL).hex() == PINNED["ns_model"]
    assert namespace_hash(MODEL, "tenant-a").hex() == PINNED["ns_model_salt"]
    got = [h.hex() for h in block_hashes(list(range(40)), 16, MODEL, "tenant-a")]
    assert got == PINNED["chain_0_40_bs16_salt"]
    assert [h.hex() for h in block_hashes([1, 2, 3, 4], 4, "m")] == PINNED["chain_1234_bs4"]
    assert namespace_hash(MODEL, "tenant-a", ADAPTER).hex() == PINNED["ns_model_salt_adapter"]
    got = [h.hex() for h in block_hashes(list(range(40)), 16, MODEL, "tenant-a", ADAPTER)]
    assert got == PINNED["chain_0_40_bs16_salt_adapter"]


def test_adapter_layout_matches_the_documented_definition():
    raw = [s.encode() for s in (MODEL, "salt", ADAPTER)]
    model, salt, adapter = (struct.pack("<I", len(r)) + r for r in raw)
    want = hashlib.blake2b(model + salt + b"L" + adapter, digest_size=16, person=b"kvharbor-ns-v1").digest()
    assert namespace_hash(MODEL, "salt", ADAPTER) == want


def test_an_adapter_never_shares_blocks_with_the_base_or_another_adapter():
    tokens = list(range(32))
    chains = [block_hashes(tokens, 16, MODEL, "t", a) for a in (None, "a@1", "b@1", "a@2")]
    assert len({h for chain in chains for h in chain}) == 8
    assert block_hashes(tokens, 16, MODEL, "t", "") == chains[0]  # no adapter: the base namespace


def test_byte_layout_matches_the_documented_definition():
    # An independent re-derivation from the docstring: BLAKE2b-128, personalised, little-endian
    # length-prefixed UTF-8 strings for the namespace and little-endian int32 token ids.
    def lp(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<I", len(raw)) + raw

    ns = hashlib.blake2b(lp(MODEL) + lp("salt"), digest_size=16, person=b"kvharbor-ns-v1").digest()
    h0 = hashlib.blake2b(ns + struct.pack("<4i", 7, 8, 9, 10), digest_size=16, person=b"kvharbor-blk-v1").digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4i", 11, 12, 13, 14), digest_size=16, person=b"kvharbor-blk-v1").digest()
    assert block_hashes([7, 8, 9, 10, 11, 12, 13, 14, 15], 4, MODEL, "salt") == [h0, h1]


def test_partial_last_block_is_never_hashed():
    assert len(block_hashes(list(range(31)), 16, MODEL)) == 1
    assert len(block_hashes(list(range(32)), 16, MODEL)) == 2
    assert block_hashes(list(range(15)), 16, MODEL) == []


def test_salt_and_model_isolate_chains():
    tokens = list(range(32))
    a = block_hashes(tokens, 16, MODEL, "tenant-a")
    b = block_hashes(tokens, 16, MODEL, "tenant-b")
    other_model = block_hashes(tokens, 16, "other-model", "tenant-a")
    assert not set(a) & set(b)
    assert not set(a) & set(other_model)
    # None and "" both mean "no salt".
    assert block_hashes(tokens, 16, MODEL, None) == block_hashes(tokens, 16, MODEL, "")


def test_namespace_fields_cannot_be_confused():
    # Length prefixes keep ("ab", "c") apart from ("a", "bc").
    assert namespace_hash("ab", "c") != namespace_hash("a", "bc")


def test_a_block_hash_depends_on_every_earlier_token():
    base = list(range(48))
    changed = list(base)
    changed[3] = 999
    h_base, h_changed = block_hashes(base, 16, MODEL), block_hashes(changed, 16, MODEL)
    assert all(x != y for x, y in zip(h_base, h_changed, strict=True))


def test_incremental_extension_equals_hashing_at_once():
    tokens = list(range(100))
    ns = namespace_hash(MODEL, "s")
    hashes: list[bytes] = []
    for end in (5, 16, 17, 40, 64, 100):
        extend_block_hashes(hashes, tokens[:end], 16, ns)
    assert hashes == block_hashes(tokens, 16, MODEL, "s")


def test_hex_round_trip_and_bad_hex():
    h = hash_block(namespace_hash(MODEL), [1, 2, 3])
    assert from_hex(to_hex(h)) == h
    with pytest.raises(ValueError):
        from_hex("abcd")
    with pytest.raises(ValueError):
        from_hex("zz" * 16)


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5]])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(ValueError):
        hash_block(namespace_hash(MODEL), bad)


def test_bad_arguments():
    with pytest.raises(ValueError):
        namespace_hash("")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, MODEL)
