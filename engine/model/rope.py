"""RoPE: the inverse frequencies of rotary position embeddings for a ModelArch, with the scalings
kvharbor reads (linear, Llama 3, YaRN, Phi-3's LongRoPE, a GGUF's per-frequency factors), and the
long-context half that LongRoPE and YaRN switch to past the original context. The decoder
(engine/model/decoder.py) turns them into cos/sin per position."""

from __future__ import annotations

import math

import torch

from kvharbor.engine.model.arch import ModelArch


def base_inv_freq(theta: float, d: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse RoPE frequencies (float32), with Llama 3 / linear scaling applied."""
    inv_freq = base_inv_freq(arch.rope_theta, arch.head_dim)
    scaling = arch.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = arch.rope_kind
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    if kind == "longrope":
        return _longrope(arch, inv_freq, "short_factor")
    if kind == "yarn":
        return _yarn(arch, inv_freq)
    if kind == "freq_factors":  # a GGUF's rope_freqs.weight (engine/model/gguf_loader.py)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3, longrope, yarn)")


def _yarn(arch: ModelArch, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (Qwen2.5's long context): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by the factor), those that turn more than
    beta_fast times kept, a linear ramp between, over dimension indices (rounded out unless
    `truncate` is false)."""
    scaling = arch.rope_scaling_dict
    factor, original = arch.yarn_stretch()
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    d, base = arch.head_dim, arch.rope_theta

    def dim_of(turns: float) -> float:  # the dimension index whose frequency turns `turns` times
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(arch: ModelArch) -> float:
    """The cos/sin scale YaRN asks for: attention_factor, else 0.1 ln(factor) + 1 (with DeepSeek's
    mscale / mscale_all_dim ratio where both are given)."""
    scaling = arch.rope_scaling_dict
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, _ = arch.yarn_stretch()

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale()


def _longrope(arch: ModelArch, inv_freq: torch.Tensor, which: str) -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor (short_factor within the original
    context, long_factor beyond it)."""
    factors = torch.tensor(arch.rope_scaling_dict[which], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"longrope {which} has {factors.numel()} factors, the heads need {inv_freq.numel()}")
    return inv_freq / factors


def rope_extension(arch: ModelArch) -> tuple[torch.Tensor | None, int, float]:
    """LongRoPE's and YaRN's other half: (the long-context inverse frequencies, the position from
    which they apply, the cos/sin scale). YaRN has one set of frequencies: (None, 0, its scale).
    (None, 0, 1.0) for every other RoPE.

    NOTE: per position, as vLLM does: positions past original_max_position_embeddings take the
    long factors, earlier ones the short. transformers switches every position once a sequence
    passes that length, which a KV cache (its keys rotated already) cannot follow; the two agree
    on every sequence within the original context."""
    scaling = arch.rope_scaling_dict
    kind = arch.rope_kind
    if kind == "yarn":
        return None, 0, _yarn_attention_factor(arch)
    if kind != "longrope":
        return None, 0, 1.0
    base = base_inv_freq(arch.rope_theta, arch.head_dim)
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or arch.max_position_embeddings / original
    scale = scaling.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return _longrope(arch, base, "long_factor"), original, float(scale)
