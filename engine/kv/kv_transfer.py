"""KV blocks as bytes: what an engine puts into the shared block store and loads back from it.

One block's payload is its K and V for every layer, `[layers, 2, kv_heads, block_size, head_dim]`
in the engine's dtype, C order: the layout string "hm1:L..:H..:D..:B.." names exactly that. The
weights fingerprint tells engines with other weights under the same model name apart, so their
blocks are refused instead of silently producing wrong text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from kvharbor.engine.quantize import QuantWeight
from kvharbor.kvcache_service.block_store import BlockFormat

LAYOUT_VERSION = "hm1"  # head-major pool, see engine/runner.py


def weights_fingerprint(state_dict: Mapping[str, torch.Tensor | QuantWeight]) -> str:
    """A digest of tensor names, shapes and a sample of values: cheap, and it differs whenever the
    weights do in practice (another checkpoint, another quantization, a fine-tune)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        t = state_dict[name]
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else (t.n, t.k)
        if isinstance(t, QuantWeight):  # kept GGUF blocks: a few dequantized rows
            t = t.dequantize(torch.unique(torch.linspace(0, t.n - 1, 3).long()))
        flat = t.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:], flat[:: max(1, flat.numel() // 64)][:64]])
        h.update(f"{name}:{shape}:".encode())
        h.update(sample.to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()


class KVBlockIO:
    """Copies whole blocks out of, and into, the runner's KV tensor `[L, 2, H, slots, D]`."""

    def __init__(
        self,
        kv_caches: torch.Tensor,
        block_size: int,
        model: str,
        fingerprint: str,
        kv_dtype: str = "auto",
        head_dim: int | None = None,
    ) -> None:
        layers, two, heads, slots, row = kv_caches.shape
        self.block_size = block_size
        self.shape = (layers, two, heads, block_size, row)
        self._blocks = kv_caches.view(layers, two, heads, slots // block_size, block_size, row)
        self.dtype = kv_caches.dtype
        # 8-bit caches (engine/kv/kv_quant.py): byte rows of head_dim codes + a bf16 scale, tagged with
        # their code type, so a store or a peer never hands them to a float engine or back.
        quantized = kv_dtype != "auto"
        dim = head_dim if quantized and head_dim else row
        self.format = BlockFormat(
            model=model,
            fingerprint=fingerprint,
            layout=f"{LAYOUT_VERSION}:L{layers}:H{heads}:D{dim}:B{block_size}" + (":R+bf16scale" if quantized else ""),
            dtype=kv_dtype if quantized else str(kv_caches.dtype).removeprefix("torch."),
            block_bytes=kv_caches.element_size() * layers * two * heads * block_size * row,
        )

    def export(self, block_ids: Sequence[int]) -> list[bytes]:
        if not block_ids:
            return []
        index = torch.tensor(list(block_ids), device=self._blocks.device)
        # [L, 2, H, n, bs, D] -> [n, L, 2, H, bs, D]: one contiguous payload per block.
        picked = self._blocks.index_select(3, index).permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        raw = picked.view(torch.uint8).view(len(block_ids), -1).numpy()
        return [row.tobytes() for row in raw]

    def load(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} blocks but {len(payloads)} payloads")
        if not block_ids:
            return
        size = self.format.block_bytes
        bad = next((len(p) for p in payloads if len(p) != size), None)
        if bad is not None:
            raise ValueError(f"a KV block payload is {bad} bytes, expected {size}")
        raw = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)  # one copy, writable
        data = raw.view(self.dtype).view(len(block_ids), *self.shape).permute(1, 2, 3, 0, 4, 5)
        index = torch.tensor(list(block_ids), device=self._blocks.device)
        self._blocks.index_copy_(3, index, data.to(self._blocks.device))
