"""ModelArch: the shape of a Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3), read
from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvharbor.engine.model.attention import LayerAttention

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
SLIDING, FULL_ATTENTION = "sliding_attention", "full_attention"
# Gemma 3 checkpoints older than transformers' layer_types: every 6th layer is global.
GEMMA_PATTERNS = {"gemma2": 2, "gemma3_text": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's sliding layers' RoPE base where a config omits it
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    qk_norm: bool = False  # an RMS norm over each query and key head before RoPE (Qwen3, Gemma 3)
    # A sliding window (Mistral, Phi-3, Gemma): the layers named sliding_attention in layer_types
    # (every layer when layer_types is None) attend to the last sliding_window positions only.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base, unscaled (Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_tanh (Gemma)
    # Three features Gemma has (each named for what it does, not for the family):
    sandwich_norms: bool = False  # norms after attention and after the MLP too (their own weights)
    norm_plus_one: bool = False  # norm weights stored as w - 1: the norm multiplies by 1 + w, in float32
    embed_scale: bool = False  # the embedding scaled by sqrt(hidden)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5 (Gemma)
    attn_softcap: float | None = None  # Gemma 2: scores soft-capped, cap * tanh(score / cap)
    final_softcap: float | None = None  # Gemma 2: logits soft-capped

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; kvharbor runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split over {self.num_kv_heads} KV heads")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL_ATTENTION}:
                raise ValueError(
                    f"layer_types must name {SLIDING} or {FULL_ATTENTION} for each of the {self.num_layers} layers"
                )
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types names sliding_attention layers but the config has no sliding_window")

    def is_sliding(self, layer: int) -> bool:
        if not self.sliding_window:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    def attention(self, layer: int) -> LayerAttention:
        """What layer `layer`'s attention needs beyond the step's metadata (engine/model/attention.py)."""
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5
        window = self.sliding_window if self.is_sliding(layer) else None
        return LayerAttention(window, scale, self.attn_softcap)

    @property
    def attention_features(self) -> str | None:
        """What this model's attention needs beyond causal softmax(q.k / sqrt(d)), in words; None: nothing."""
        needs = [
            "sliding windows" if self.windows else "",
            "score soft-caps" if self.attn_softcap else "",
            "query_pre_attn_scalar score scale" if self.query_pre_attn_scalar is not None else "",
        ]
        return ", ".join(n for n in needs if n) or None

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (at most one today)."""
        return (self.sliding_window,) if any(self.is_sliding(i) for i in range(self.num_layers)) else ()

    @property
    def rope_kind(self) -> str | None:
        """The RoPE scaling's type (linear, llama3, longrope, yarn, freq_factors), None unscaled."""
        scaling = self.rope_scaling_dict
        return scaling.get("rope_type", scaling.get("type")) if scaling else None

    def yarn_stretch(self) -> tuple[float, int]:
        """(YaRN's stretch factor, the original context): the factor as given, else the ratio of
        max_position_embeddings to the original context (DeepSeek's configs leave it out)."""
        scaling = self.rope_scaling_dict or {}
        original = int(scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
        return float(scaling.get("factor") or self.max_position_embeddings / original), original

    @property
    def context_limit(self) -> int:
        """The longest context the model serves: max_position_embeddings, or under yarn the original
        context times the factor, as vLLM reads it (Qwen2.5's yarn configs keep 32,768 with factor
        4: 131,072 tokens)."""
        if self.rope_kind != "yarn":
            return self.max_position_embeddings
        factor, original = self.yarn_stretch()
        return max(self.max_position_embeddings, int(original * factor))

    @property
    def kv_window(self) -> int | None:
        """The window every layer slides within (Mistral, Phi-3): KV blocks wholly before it are
        never read again. None when any layer attends to the whole context (Gemma's global
        layers; freeing for those needs a pool per layer kind, as vLLM's hybrid allocator has)."""
        sliding = all(self.is_sliding(i) for i in range(self.num_layers))
        return self.sliding_window if sliding and self.sliding_window else None

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
        per_layer = attn + 3 * h * i + (4 if self.sandwich_norms else 2) * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Read a HF config.json dict; raises ValueError naming what is missing or unsupported."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            raise ValueError(
                "this is a multimodal Gemma 3 checkpoint (model_type gemma3); kvharbor serves Gemma 3's text "
                "model: use a gemma3_text checkpoint (such as gemma-3-270m or gemma-3-1b)"
            )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            rope_theta, local_theta, scaling = _rope(model_type, cfg)
            act = _check_supported(model_type, cfg)
            gemma = model_type in GEMMA
            window, layer_types = _windows(model_type, cfg, num_layers)
            return cls(
                architecture=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                rope_scaling=_frozen(scaling),
                qk_norm=model_type in ("qwen3", "gemma3_text"),
                sliding_window=window,
                layer_types=layer_types,
                local_rope_theta=local_theta,
                hidden_act=act,
                sandwich_norms=gemma,
                norm_plus_one=gemma,
                embed_scale=gemma,
                query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
                attn_softcap=_positive(cfg.get("attn_logit_softcapping")),
                final_softcap=_positive(cfg.get("final_logit_softcapping")),
            )
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}") from None


def _rope(model_type: str, cfg: dict[str, Any]) -> tuple[float, float | None, dict[str, Any] | None]:
    """(the RoPE base, the sliding layers' own base or None, the scaling dict or None). Gemma 3 keeps
    one rope dict per layer kind (transformers 5) or rope_theta + rope_local_base_freq (older)."""
    params = cfg.get("rope_parameters")
    local = None
    if model_type == "gemma3_text":
        per_kind = params if isinstance(params, dict) and FULL_ATTENTION in params else {}
        params = per_kind.get(FULL_ATTENTION) or cfg.get("rope_scaling")
        local_params = per_kind.get(SLIDING) or {}
        local = float(local_params.get("rope_theta") or cfg.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA)
        if local_params.get("rope_type", "default") != "default":
            raise ValueError("Gemma 3 with scaled RoPE on its sliding layers is not supported")
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or (params or {}).get("rope_theta")
                  or (1e6 if model_type == "gemma3_text" else 10000.0))  # fmt: skip
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    original = cfg.get("original_max_position_embeddings")
    if scaling and original and "original_max_position_embeddings" not in scaling:
        scaling = {**scaling, "original_max_position_embeddings": original}  # Phi-3 keeps it outside
    return theta, local, scaling


def _windows(model_type: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(the sliding window, each layer's kind or None for all alike). transformers 5 writes
    layer_types; older Gemma configs give a pattern (every n-th layer global), Mistral and Phi-3
    window every layer, Qwen2 only with use_sliding_window."""
    windowed = cfg.get("use_sliding_window", model_type in ("mistral", "phi3", *GEMMA))
    window = cfg.get("sliding_window") if windowed else None
    types = cfg.get("layer_types")
    if not window:
        return None, None if types is None else tuple(types)
    if types is None and model_type in GEMMA:
        types = gemma_layer_types(model_type, num_layers, cfg.get("sliding_window_pattern"))
    return int(window), None if types is None else tuple(types)


def gemma_layer_types(model_type: str, num_layers: int, every: int | None = None) -> tuple[str, ...]:
    """Gemma's layer kinds by its pattern: every `every`-th layer global (default: the family's),
    the rest sliding, as transformers and llama.cpp both derive them."""
    every = int(every or GEMMA_PATTERNS[model_type])
    return tuple(SLIDING if (i + 1) % every else FULL_ATTENTION for i in range(num_layers))


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _check_supported(model_type: str, cfg: dict[str, Any]) -> str:
    """Refuse, by name, the features of a supported family that this engine does not run; returns
    the MLP's activation (ACTIVATIONS' name)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    expected = "gelu_tanh" if model_type in GEMMA else "silu"
    if ACTIVATIONS.get(act) != expected:
        raise ValueError(
            f"{model_type} with hidden_act {act!r} is not supported (kvharbor runs {model_type} with {expected})"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention is an encoder; kvharbor serves decoders")
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{model_type} with partial_rotary_factor {partial} is not supported (RoPE over whole heads)")
    return ACTIVATIONS[act]


def _frozen(scaling: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """The HF rope dict as a hashable tuple (longrope's factor lists as tuples)."""
    if not scaling:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
