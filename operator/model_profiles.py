"""What the operator must know of a model to place it: parameters and the KV-cache shape.

The operator never loads weights (it runs in a slim image), so known models are listed here and an
InferenceService may give the numbers itself (`model.profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1}
# Bytes per linear-layer parameter as the engine holds each --quantization mode
# (engine/quantize.py): int8 is a byte plus a float32 scale per output row (rows at least 512
# long here); int4 and a GGUF file's 4-bit blocks are 16 bytes of nibbles plus a float32 scale and
# min per group of 32; its Q8_0 blocks are 32 bytes and a scale. The operator cannot see which a
# file holds, so gguf is placed at Q8_0's size unless spec.ggufBits says 4 (under-counting would
# over-pack a GPU); the embedding and LM head stay at the float dtype (their blocks, if any, are
# smaller still).
QUANT_BYTES = {"int8": 1 + 4 / 512, "int4": 24 / 32, "gguf": 36 / 32}
GGUF_BYTES = {4: 24 / 32, 8: 36 / 32}
QUANTIZATIONS = ("none", *QUANT_BYTES)
KV_8BIT = ("int8", "fp8")


@dataclass(frozen=True)
class ModelProfile:
    name: str
    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    linear_parameters: int = 0  # of the projections, which quantization shrinks; 0: not known
    # The projections' shapes, for sizing LoRA adapters; 0: not known.
    hidden_size: int = 0
    intermediate_size: int = 0
    attention_heads: int = 0

    def weight_bytes(self, dtype: str, quantization: str = "none", gguf_bits: int = 8) -> int:
        """The weights as the engine holds them: all at `dtype`, or the projections quantized
        (`gguf_bits`: 4 or 8, the kind of blocks a gguf file holds)."""
        if quantization == "none":
            return self.parameters * dtype_bytes(dtype)
        if quantization not in QUANT_BYTES:
            raise ValueError(f"unknown quantization {quantization!r}; one of {', '.join(QUANTIZATIONS)}")
        if not 0 < self.linear_parameters <= self.parameters:
            raise ValueError(
                f"model {self.name!r} needs model.profile.linearParameters (the projections' parameters) "
                f"to be placed with quantization {quantization}"
            )
        if gguf_bits not in GGUF_BYTES:
            raise ValueError(f"ggufBits must be 4 or 8, got {gguf_bits!r}")
        per = GGUF_BYTES[gguf_bits] if quantization == "gguf" else QUANT_BYTES[quantization]
        rest = (self.parameters - self.linear_parameters) * dtype_bytes(dtype)
        return int(self.linear_parameters * per) + rest

    def kv_bytes_per_token(self, dtype: str, kv_cache_dtype: str = "auto") -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes (engine/kv/capacity.py); an 8-bit cache
        (kvCacheDtype int8 / fp8) takes head_dim + 2 bytes a row: the codes and a bfloat16 scale
        (engine/kv/kv_quant.py)."""
        if kv_cache_dtype in KV_8BIT:
            return 2 * self.layers * self.kv_heads * (self.head_dim + 2)
        if kv_cache_dtype != "auto":
            raise ValueError(f"unknown kvCacheDtype {kv_cache_dtype!r}; one of auto, {', '.join(KV_8BIT)}")
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(dtype)

    def lora_parameters_per_rank(self) -> int:
        """Parameters of one LoRA adapter per unit of rank at the worst case, every projection
        targeted (q, k, v, o, gate, up, down): each an A (rank x in) and a B (out x rank), so
        in + out a projection, per layer."""
        h, inter, heads, kv = self.hidden_size, self.intermediate_size, self.attention_heads, self.kv_heads
        if not (h > 0 and inter > 0 and heads > 0):
            raise ValueError(
                f"model {self.name!r} needs model.profile.hiddenSize, intermediateSize and attentionHeads "
                "to size its LoRA adapters"
            )
        q, kv_out = heads * self.head_dim, kv * self.head_dim
        #           q        k, v             o        gate, up         down
        per_layer = (h + q) + 2 * (h + kv_out) + (q + h) + 2 * (h + inter) + (inter + h)
        return per_layer * self.layers

    def lora_bytes(self, slots: int, rank: int, loaded: int, dtype: str) -> int:
        """What an engine reserves for LoRA out of its memory (engine/lora/lora_manager.py
        `reserved_bytes`): `slots` (--max-loras) adapter slots of `rank` (--max-lora-rank) on
        every projection at the model's dtype, plus `loaded` (--max-cpu-loras) adapters counted
        at that rank in float32 (their loaded copies). Smaller adapters take less of it."""
        return self.lora_parameters_per_rank() * rank * (slots * dtype_bytes(dtype) + loaded * 4)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPE_BYTES)}") from None


KNOWN = {
    p.name: p
    for p in (
        # linear_parameters: layers x (q, k, v, o, gate, up, down), from each model's config.json
        # (the rest is the embedding, an untied LM head, norms and biases); then hidden_size,
        # intermediate_size and num_attention_heads from the same file.
        ModelProfile("SmolLM2-135M-Instruct", 134_515_008, 30, 3, 64, 106_168_320, 576, 1536, 9),
        # KV counted for all 18 layers, though 15 attend within 512 tokens: an upper bound
        ModelProfile("gemma-3-270m", 268_098_176, 18, 1, 256, 100_270_080, 640, 2048, 4),
        ModelProfile("Llama-3.1-8B-Instruct", 8_030_261_248, 32, 8, 128, 6_979_321_856, 4096, 14336, 32),
        ModelProfile("Llama-3.1-70B-Instruct", 70_553_706_496, 80, 8, 128, 68_451_041_280, 8192, 28672, 64),
        ModelProfile("Qwen2.5-7B-Instruct", 7_615_616_512, 28, 4, 128, 6_525_288_448, 3584, 18944, 28),
        ModelProfile("Mistral-7B-Instruct-v0.3", 7_248_023_552, 32, 8, 128, 6_979_321_856, 4096, 14336, 32),
    )
}


def profile_for(name: str, override: dict | None = None) -> ModelProfile:
    """The profile of a known model, or one built from `override` (parameters, layers, kvHeads,
    headDim; linearParameters for quantized placement; hiddenSize, intermediateSize and
    attentionHeads for LoRA adapters)."""
    if override:
        try:
            return ModelProfile(
                name,
                int(override["parameters"]),
                int(override["layers"]),
                int(override["kvHeads"]),
                int(override["headDim"]),
                int(override.get("linearParameters", 0)),
                int(override.get("hiddenSize", 0)),
                int(override.get("intermediateSize", 0)),
                int(override.get("attentionHeads", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"model.profile needs integer parameters, layers, kvHeads and headDim (and linearParameters): {exc}"
            ) from None
    if name not in KNOWN:
        raise ValueError(
            f"model {name!r} has no known profile; give model.profile (parameters, layers, kvHeads, headDim) "
            f"or use one of {sorted(KNOWN)}"
        )
    return KNOWN[name]
