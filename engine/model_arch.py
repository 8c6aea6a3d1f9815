"""ModelArch: the shape of a Llama-family decoder, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    qk_norm: bool = False  # an RMS norm over each query and key head before RoPE (Qwen3)
    # A sliding window (Mistral, Phi-3): the served context is capped at it, where it never binds.
    # NOTE: windowed attention over the paged cache is not built yet; capping is the honest answer
    # (a window silently ignored past its length would be a wrong answer, not an error).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; kvharbor runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split over {self.num_kv_heads} KV heads")

    @property
    def context_limit(self) -> int:
        """The longest sequence this engine serves the model at: its positions, and its window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Read a HF config.json dict; raises ValueError naming what is missing or unsupported."""
        model_type = cfg.get("model_type", "")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            rope_theta = float(cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0)
            if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            original = cfg.get("original_max_position_embeddings")
            if scaling and original and "original_max_position_embeddings" not in scaling:
                scaling = {**scaling, "original_max_position_embeddings": original}  # Phi-3 keeps it outside
            windowed = cfg.get("use_sliding_window", model_type in ("mistral", "phi3"))
            window = cfg.get("sliding_window") if windowed else None
            _check_supported(model_type, cfg)
            return cls(
                architecture=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                rope_scaling=_frozen(scaling),
                qk_norm=model_type == "qwen3",
                sliding_window=int(window) if window else None,
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None


def _check_supported(model_type: str, cfg: dict[str, Any]) -> None:
    """Refuse, by name, the features of a supported family that this engine does not run."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type} with hidden_act {act!r} is not supported (kvharbor runs silu MLPs)")
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{model_type} with partial_rotary_factor {partial} is not supported (RoPE over whole heads)")


def _frozen(scaling: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """The HF rope dict as a hashable tuple (longrope's factor lists as tuples)."""
    if not scaling:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
