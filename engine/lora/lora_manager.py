"""LoRAManager: the adapters an engine serves, which of them hold a slot, and who uses each slot.

Loaded adapters (at most --max-cpu-loras) stay in CPU memory. A step can run --max-loras of them:
those hold a slot (engine/lora/lora_slots.py). The scheduler asks `can_run` before it admits a
request on an adapter and `acquire`s its slot when it does; a slot's adapter stays while any
running request uses it, and a slot nobody uses is taken over least recently used first (the
swap copies the adapter's weights into it). A waiting request whose adapter cannot get a slot is
passed over this step, not refused; the scheduler then holds new requests off the slot that will
free first (`first_to_free`), so that slot drains for it.
"""

from __future__ import annotations

import time

import torch

from kvharbor.engine.core_io import AdapterInUse, UnknownModel
from kvharbor.engine.cpu.cpu_kernels import CpuKernels
from kvharbor.engine.lora.adapter import AdapterError, LoRAAdapter, sub_shapes
from kvharbor.engine.lora.lora_slots import LoRASlots, LoRAStep
from kvharbor.engine.model.arch import ModelArch


class UnknownAdapter(UnknownModel):
    """A request for an adapter this engine does not serve (the API answers 404)."""


class AdapterBusy(AdapterError, AdapterInUse):
    """An adapter that requests use cannot be unloaded (the API answers 409)."""


class LoRAManager:
    def __init__(
        self,
        arch: ModelArch,
        num_slots: int,
        max_rank: int,
        max_loaded: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,  # the CPU kernels, where they run
    ) -> None:
        self.arch = arch
        self.max_rank, self.max_loaded = max_rank, max_loaded
        self.slots = LoRASlots(arch, num_slots, max_rank, dtype, device, kernels)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.holder: list[str | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.last_used = [0] * num_slots
        self._clock = 0
        self.swaps = 0
        self.swap_seconds = 0.0

    # -- adapters -------------------------------------------------------------------------------

    def add(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` (read by lora.load_adapter). Raises AdapterError if the name is taken or
        the engine holds --max-cpu-loras adapters already."""
        if adapter.name in self.adapters:
            raise AdapterError(f"adapter {adapter.name!r} is already loaded: unload it first to replace it")
        if len(self.adapters) >= self.max_loaded:
            raise AdapterError(
                f"the engine holds its limit of {self.max_loaded} adapters (--max-cpu-loras): unload one first"
            )
        if adapter.rank > self.max_rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank} > --max-lora-rank {self.max_rank}")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Stop serving `name`; raises UnknownAdapter if it is not loaded, AdapterError while a
        running request uses it (the caller also checks queued ones)."""
        self.get(name)
        slot = self._slot_of(name)
        if slot is not None:
            if self.refs[slot]:
                raise AdapterBusy(f"adapter {name!r} is in use by {self.refs[slot]} running requests: retry when done")
            self.holder[slot] = None
            self.slots.clear(slot)
        del self.adapters[name]

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownAdapter(f"adapter {name!r} is not loaded on this engine (loaded: {known})")
        return adapter

    # -- slots (the scheduler) ------------------------------------------------------------------

    def can_run(self, name: str) -> bool:
        """Whether a request on `name` could run this step: its adapter holds a slot, or one is free."""
        return self._slot_of(name) is not None or self._free_slot() is not None

    def acquire(self, name: str) -> None:
        """A request on `name` starts running: hold its slot, swapping the adapter in if needed.
        Call only after can_run said yes."""
        slot = self._slot_of(name)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire without a slot: call can_run first"
            t0 = time.perf_counter()
            self.slots.write(slot, self.get(name))
            self.swap_seconds += time.perf_counter() - t0
            self.swaps += 1
            self.holder[slot] = name
        self.refs[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock

    def release(self, name: str) -> None:
        """A request on `name` stopped running (finished or preempted)."""
        slot = self._slot_of(name)
        if slot is not None and self.refs[slot]:
            self.refs[slot] -= 1

    def first_to_free(self) -> str | None:
        """The adapter whose slot the fewest running requests use (least recently used among
        equals): the one to drain for a request that waits for a slot."""
        held = [i for i, h in enumerate(self.holder) if h is not None]
        if not held:
            return None
        return self.holder[min(held, key=lambda i: (self.refs[i], self.last_used[i]))]

    def slot(self, name: str | None) -> int:
        """The slot a running request's adapter holds; -1 for the base model."""
        if name is None:
            return -1
        slot = self._slot_of(name)
        assert slot is not None, f"adapter {name!r} runs without a slot"
        return slot

    def step(self, rows: list[tuple[int, str | None]], decode_rows: int) -> LoRAStep | None:
        """One step's LoRAStep from (tokens, adapter or None) per chunk in batch order."""
        return LoRAStep.build(self.slots, [(n, self.slot(name)) for n, name in rows], decode_rows)

    def _slot_of(self, name: str) -> int | None:
        try:
            return self.holder.index(name)
        except ValueError:
            return None

    def _free_slot(self) -> int | None:
        empty = [i for i, h in enumerate(self.holder) if h is None]
        if empty:
            return empty[0]  # the lowest: decode rows' masked product covers slots [0, highest used]
        idle = [i for i, refs in enumerate(self.refs) if refs == 0]
        return min(idle, key=lambda i: self.last_used[i]) if idle else None

    # -- reporting ------------------------------------------------------------------------------

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(h for h in self.holder if h is not None)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + sum(a.nbytes for a in self.adapters.values())


def reserved_bytes(arch: ModelArch, num_slots: int, max_rank: int, max_loaded: int, element_size: int) -> int:
    """Memory LoRA may take: the slots (model dtype) and --max-cpu-loras adapters at the highest
    rank on every module (float32), so the KV pool is sized with room for them (engine/kv/capacity.py: one budget)."""
    per_rank = sum(s.d_in + s.d_out for s in sub_shapes(arch).values()) * arch.num_layers
    return per_rank * max_rank * (num_slots * element_size + max_loaded * 4)
