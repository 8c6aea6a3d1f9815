"""LoRA adapters in PEFT's format, read for kvharbor's fused projections: `load_adapter`.

A PEFT folder holds `adapter_config.json` (rank r, lora_alpha, target modules) and
`adapter_model.safetensors` with, per targeted module of each layer, `lora_A` [r, in] and
`lora_B` [out, r]. The module's output becomes `base(x) + scaling * B(A(x))`, scaling =
alpha / r (alpha / sqrt(r) with use_rslora). kvharbor fuses q/k/v into `qkv` and gate/up into
`gate_up` (engine/model/decoder.py), so each PEFT module is a *sub-projection*: a column range of a
fused output. The scaling is folded into B once here, so serving adds `(x A^T) B'^T`.

Validation is whole before anything is kept: a bad folder, an unsupported PEFT feature, a rank
above --max-lora-rank or a tensor of the wrong shape raises AdapterError and loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvharbor.common.lora import adapter_identity, check_adapter_name
from kvharbor.engine.model.arch import ModelArch

# PEFT module name -> (kvharbor's fused projection, position of the sub-projection in it).
SUB_PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}  # fmt: skip
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class SubShape:
    """A sub-projection's input width, output width and first column in its fused output."""

    projection: str
    index: int
    d_in: int
    d_out: int
    offset: int


def sub_shapes(arch: ModelArch) -> dict[str, SubShape]:
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    return {
        "q_proj": SubShape("qkv", 0, h, q, 0),
        "k_proj": SubShape("qkv", 1, h, kv, q),
        "v_proj": SubShape("qkv", 2, h, kv, q + kv),
        "o_proj": SubShape("o_proj", 0, q, h, 0),
        "gate_proj": SubShape("gate_up", 0, h, inter, 0),
        "up_proj": SubShape("gate_up", 1, h, inter, inter),
        "down_proj": SubShape("down", 0, inter, h, 0),
    }


@dataclass
class LoRAAdapter:
    """One adapter on the CPU, float32: `weights[(layer, module)] = (A [r, in], B [out, r] x scaling)`."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # of the weights file and the scaling: part of the adapter's KV identity
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def identity(self) -> str:
        return adapter_identity(self.name, self.digest)

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, arch: ModelArch, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder for this model; raises AdapterError saying what is wrong."""
    check_adapter_name(name)
    folder = Path(path)
    config = _read_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}: raise it")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{folder / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    raw, digest = _read_weights(folder, scaling)
    weights = _check_tensors(raw, arch, rank, folder)
    scaled = {key: (a.float().contiguous(), (b.float() * scaling).contiguous()) for key, (a, b) in weights.items()}
    return LoRAAdapter(name, str(folder), rank, scaling, digest, scaled)


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter path {folder} is not a folder: give a PEFT folder ({CONFIG_FILE}, {WEIGHTS_FILE})")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: is it a PEFT LoRA folder?") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{file}: peft_type {config.get('peft_type')!r} is not served; only LORA is")
    unsupported = {
        "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D models)", "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern", "modules_to_save": "modules_to_save (fully trained modules)",
    }  # fmt: skip
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"{file}: {what} is not supported; train the adapter without it")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias={config['bias']!r} is not supported; only bias='none' adapters are")
    return config


def _read_weights(folder: Path, scaling: float) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    file = folder / WEIGHTS_FILE
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        hint = " (adapter_model.bin is not read: save with safe_serialization=True)"
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}{hint}") from None
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{file} is not a valid safetensors file: {exc}") from None
    digest = hashlib.sha256(data + repr(scaling).encode()).hexdigest()[:16]
    return tensors, digest


def _check_tensors(
    raw: dict[str, torch.Tensor], arch: ModelArch, rank: int, folder: Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = sub_shapes(arch)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in shapes or int(m.group(1)) >= arch.num_layers:
            raise AdapterError(
                f"{folder / WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B of a decoder layer's "
                f"{'/'.join(shapes)} (of {arch.num_layers} layers): is it for this model?"
            )
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    if not halves:
        raise AdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA tensors")
    out = {}
    for (layer, module), pair in sorted(halves.items()):
        shape = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        where = f"{folder / WEIGHTS_FILE}: layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_{'A' if a is None else 'B'} missing")
        if tuple(a.shape) != (rank, shape.d_in) or tuple(b.shape) != (shape.d_out, rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected {(rank, shape.d_in)} and "
                f"{(shape.d_out, rank)} (rank {rank} on this model): is the adapter for another base model?"
            )
        out[(layer, module)] = (a, b)
    return out
