"""vLLM block events as kvharbor's: the block hashes recomputed from the token ids.

vLLM's own hashes depend on --prefix-caching-hash-algo, PYTHONHASHSEED and its extra keys, so they
are never reproduced: each BlockStored's token ids are hashed the kvharbor way (common/block_hash.py)
under the model, the tenant's salt and the adapter's name, chained from the parent block's kvharbor
hash. vLLM's hash of each block is kept only as the key that resolves a later BlockRemoved.
"""

from __future__ import annotations

from typing import Any

from kvharbor.common.block_hash import BlockHash, hash_block, namespace_hash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent
from kvharbor.kv_bridge.vllm_events import VllmCleared, VllmEvent, VllmRemoved, VllmStored


class BlockSizeMismatch(ValueError):
    """The pod's blocks are cut by another size than the gateway's: its prefixes would never match."""


class Translator:
    """One vLLM engine's events, translated in order. `orphans` counts stored runs whose parent
    was never seen (dropped: their hashes cannot be computed), `unknown_removed` removed blocks
    never stored (nothing to remove)."""

    def __init__(self, model: str, block_size: int) -> None:
        self.model, self.block_size = model, block_size
        self._ours: dict[int | bytes, BlockHash] = {}  # vLLM's block hash -> kvharbor's
        self.orphans = 0
        self.unknown_removed = 0

    @property
    def size(self) -> int:
        """Blocks this engine holds, as far as its events said."""
        return len(self._ours)

    def held(self) -> list[BlockHash]:
        """Their kvharbor hashes (a re-sync's full set)."""
        return list(self._ours.values())

    def clear(self) -> None:
        self._ours.clear()

    def translate(self, event: VllmEvent) -> KVEvent | None:
        """The kvharbor event for `event`, or None when there is nothing to tell. Raises
        BlockSizeMismatch for blocks of another size than the gateway's."""
        if isinstance(event, VllmCleared):
            self.clear()
            return AllCleared()
        if isinstance(event, VllmRemoved):
            ours = tuple(self._ours.pop(h) for h in event.block_hashes if h in self._ours)
            self.unknown_removed += len(event.block_hashes) - len(ours)
            return BlockRemoved(ours) if ours else None
        return self._stored(event)

    def _stored(self, event: VllmStored) -> BlockStored | None:
        if event.block_size != self.block_size:
            raise BlockSizeMismatch(
                f"the vLLM engine cuts KV blocks of {event.block_size} tokens and the gateway {self.block_size}: "
                f"start it with --block-size {self.block_size}, or its prefixes never match"
            )
        if event.parent is None:
            parent, chain = None, namespace_hash(self.model, salt_of(event), event.lora_name)
        elif (parent := self._ours.get(event.parent)) is None:
            self.orphans += 1
            return None
        else:
            chain = parent
        hashes = []
        size = self.block_size
        for i, theirs in enumerate(event.block_hashes):
            chain = hash_block(chain, event.token_ids[i * size : (i + 1) * size])
            self._ours[theirs] = chain
            hashes.append(chain)
        return BlockStored(tuple(hashes), parent, size)


def salt_of(event: VllmStored) -> str | None:
    """The cache salt of a chain's first block: vLLM puts it in block 0's extra keys, after the
    LoRA name (when the request has one) and any multimodal (identifier, offset) pairs."""
    keys: Any = event.extra_keys[0] if event.extra_keys else None
    if not isinstance(keys, list | tuple):
        return None
    rest = list(keys[1:] if event.lora_name and keys and keys[0] == event.lora_name else keys)
    return next((k for k in rest if isinstance(k, str)), None)
