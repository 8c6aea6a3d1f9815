"""What the operator must know of a model to place it: parameters and the KV-cache shape.

The operator never loads weights (it runs in a slim image), so known models are listed here and an
InferenceService may give the numbers itself (`model.profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    parameters: int
    layers: int
    kv_heads: int
    head_dim: int

    def weight_bytes(self, dtype: str) -> int:
        return self.parameters * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes (DESIGN §3)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPE_BYTES)}") from None


KNOWN = {
    p.name: p
    for p in (
        ModelProfile("SmolLM2-135M-Instruct", 134_515_008, 30, 3, 64),
        ModelProfile("Llama-3.1-8B-Instruct", 8_030_261_248, 32, 8, 128),
        ModelProfile("Llama-3.1-70B-Instruct", 70_553_706_496, 80, 8, 128),
        ModelProfile("Qwen2.5-7B-Instruct", 7_615_616_512, 28, 4, 128),
        ModelProfile("Mistral-7B-Instruct-v0.3", 7_248_023_552, 32, 8, 128),
    )
}


def profile_for(name: str, override: dict | None = None) -> ModelProfile:
    """The profile of a known model, or one built from `override` (parameters, layers, kvHeads, headDim)."""
    if override:
        try:
            return ModelProfile(
                name,
                int(override["parameters"]),
                int(override["layers"]),
                int(override["kvHeads"]),
                int(override["headDim"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model.profile needs integer parameters, layers, kvHeads and headDim: {exc}") from None
    if name not in KNOWN:
        raise ValueError(
            f"model {name!r} has no known profile; give model.profile (parameters, layers, kvHeads, headDim) "
            f"or use one of {sorted(KNOWN)}"
        )
    return KNOWN[name]
