"""Block hashing: the one function the engine, the KV index and the gateway all use; a contract in common/.

A prompt is cut into full blocks of `block_size` tokens; a partial last block is never hashed.

    namespace = H_ns(len(model) || model || len(salt) || salt [|| "L" || len(adapter) || adapter])
    hash_0    = H(namespace || tokens_0)
    hash_i    = H(hash_{i-1} || tokens_i)

`H` is BLAKE2b with a 16-byte (128-bit) digest. Token ids are packed as little-endian int32, and
strings as UTF-8 with a little-endian uint32 length prefix, so no two inputs share a byte layout.
The reference vectors in tests/test_block_hash.py pin this: changing any byte here is a breaking
change of the wire contract and must bump HASH_VERSION.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = 1
DIGEST_SIZE = 16
DEFAULT_BLOCK_SIZE = 16

# BLAKE2b personalization keeps our digests apart from any other use of BLAKE2b on the same bytes.
_NS_PERSON = b"kvharbor-ns-v1"
_BLOCK_PERSON = b"kvharbor-blk-v1"
_INT32_MAX = 2**31 - 1

BlockHash = bytes


def _len_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def namespace_hash(model: str, cache_salt: str | None = None, adapter: str | None = None) -> BlockHash:
    """The parent of block 0: binds every chain to one model id, one cache salt and one LoRA
    adapter identity (common/lora.py: `name@digest`; None for the base model).

    `None` and "" are the same salt (no isolation); the gateway always passes the tenant's salt.
    The base model's namespace has no adapter field at all, so its digests are those of
    HASH_VERSION 1 before adapters existed; the "L" tag keeps the two layouts apart.
    """
    if not isinstance(model, str) or not model:
        raise ValueError("block hashing needs a non-empty model id")
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_NS_PERSON)
    h.update(_len_prefixed(model))
    h.update(_len_prefixed(cache_salt or ""))
    if adapter:
        h.update(b"L" + _len_prefixed(adapter))
    return h.digest()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian int32 bytes of `token_ids`; raises ValueError for ids outside [0, 2**31)."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_INT32_MAX}]: {exc}") from None


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained to its parent (the namespace hash for block 0)."""
    if any(t < 0 for t in token_ids):
        raise ValueError("token ids must be non-negative")
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_BLOCK_PERSON)
    h.update(parent)
    h.update(pack_tokens(token_ids))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, in order. The partial tail is not hashed."""
    return extend_block_hashes([], token_ids, block_size, namespace_hash(model, cache_salt, adapter))


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    namespace: BlockHash,
) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` not hashed yet; return it.

    Lets a growing sequence hash each block once: call again after tokens are appended.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = hashes[-1] if hashes else namespace
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def to_hex(block_hash: BlockHash) -> str:
    return block_hash.hex()


def from_hex(text: str) -> BlockHash:
    """Parse a wire hash; raises ValueError unless it is exactly DIGEST_SIZE bytes of hex."""
    raw = bytes.fromhex(text)
    if len(raw) != DIGEST_SIZE:
        raise ValueError(f"a block hash is {DIGEST_SIZE} bytes ({2 * DIGEST_SIZE} hex digits), got {len(raw)}")
    return raw
