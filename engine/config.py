"""The engine's frozen configuration: what to load, how to cache, how to schedule.

Every leaf is a flag (`--block-size`), an env var (`KVHARBOR_BLOCK_SIZE`) and a YAML key
(`block_size`): see kvharbor.config. Values computed at start-up (number of KV blocks, bytes per
token) live in `engine.capacity.KVCapacity`, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvharbor.common.config import opt, parse_bytes
from kvharbor.common.redis_client import check_url
from kvharbor.common.redis_keys import STREAM_PREFIX
from kvharbor.common.request_limits import RequestLimits
from kvharbor.common.server_config import TracedListenConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = opt(
        None, "HF folder, .gguf file or bundled name (gemma-3-270m); empty means the bundled SmolLM2-135M-Instruct"
    )
    served_model_name: str | None = opt(None, "model id in the API and in block hashes (default: file stem)")
    dtype: Dtype = opt(
        "auto",
        "weights/activations dtype; auto = bfloat16 on CUDA; on CPU with float weights, whichever a "
        "start-up probe measures faster (bfloat16 only at 0.9x float32's time or less); else bfloat16 "
        "on CPUs with AMX, or AVX512-BF16 unless --quantization is set, and float32 elsewhere",
    )
    max_model_len: int | None = opt(
        None, "longest prompt + output in tokens (default: the model's limit, capped to what the KV pool holds)"
    )
    device: Device = opt("auto", "where to run: cuda when available, else cpu")
    quantization: Literal["none", "int8", "int4", "gguf"] = opt(
        "none",
        "weight quantization (fast on a CPU with AVX2): none; int8 (per channel) or int4 (groups of 32) of the "
        "linear layers; gguf (a GGUF model's own Q4_0/Q4_1/Q8_0 blocks, never stored dequantized)",
    )
    engine_seed: int = opt(0, "seed of the engine RNG that seeds requests without a seed of their own")
    task: Literal["auto", "generate", "embed"] = opt(
        "auto", "what the engine serves: generate (chat, completions) or embed (/v1/embeddings); auto: embed for a "
        "model whose files declare pooling (sentence-transformers' 1_Pooling, or a bare ...Model architecture)",
    )  # fmt: skip
    pooling: Literal["auto", "last", "mean"] = opt(
        "auto", "how an embedding pools its prompt's hidden states: last token or mean; auto: as the model declares, "
        "else last",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV block (the prefix-cache and hashing granularity)")
    kv_cache_memory: str | None = opt(None, "KV pool size, e.g. 2GiB (default: a share of free memory)")
    kv_memory_fraction: float = opt(0.9, "share of free accelerator memory for KV when kv_cache_memory is unset")
    num_kv_blocks: int | None = opt(None, "exact number of KV blocks; overrides the memory budget")
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of identical prefixes")
    kv_events: bool = opt(False, "queue KV events for the KV index (serve --redis-url turns it on)")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = opt(
        "auto",
        "KV cache storage: auto (the model dtype), or int8 / fp8 (e4m3) with a bfloat16 scale per token and "
        "head: about 2x the tokens of bfloat16 and 3.9x of float32 in the same memory",
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most requests in one batch")
    max_num_batched_tokens: int = opt(1024, "token budget of one step (prefill chunks + decodes)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_method: Literal["off", "ngram", "draft"] = opt(
        "off", "speculative decoding: ngram (prompt lookup, no extra model), draft (a small model), or off"
    )
    speculative_k: int = opt(3, "most tokens proposed per request and step (adapted down when few are accepted)")
    ngram_n: int = opt(3, "longest n-gram matched against the request's own tokens (shorter ones down to 2)")
    draft_model: str | None = opt(None, "the draft model for speculative_method=draft (same tokenizer as the target)")

    def __post_init__(self) -> None:
        if not 1 <= self.speculative_k <= 16:
            raise ValueError(f"speculative_k must be in 1..16, got {self.speculative_k}")
        if not 1 <= self.ngram_n <= 16:
            raise ValueError(f"ngram_n must be in 1..16, got {self.ngram_n}")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method=draft needs draft_model (a folder or .gguf sharing the tokenizer)")


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int | None = opt(None, "CPU threads for torch (default: one per physical core)")
    cpu_kernels: bool = opt(
        True,
        "CPU fast paths for linears: bfloat16 weights prepacked for oneDNN, float32 decode rows through "
        "kvharbor's AVX2 kernel (built with the system C compiler); off: torch's matmul everywhere",
    )
    attention_backend: Literal["auto", "torch", "triton"] = opt(
        "auto", "paged attention: triton kernels (CUDA), torch (gathers blocks; CPU); auto picks by device"
    )
    cpu_affinity: str | None = opt(
        None, "run only on these CPUs, e.g. 0 or 0-3,8 (engines sharing a machine keep off each other's cores)"
    )
    batch_invariant: Literal["auto", "on", "off"] = opt(
        "auto",
        "a request's logits do not depend on the batch it shares a step with, how its prompt was chunked or "
        "where its prefix KV came from (greedy output equals the request run alone): on, off, or auto (on where "
        "it runs: CPU kernels, no LoRA, no fp8 KV, and quantized weights only where they run on the packed "
        "integer GEMM, AVX512-VNNI; engine/README.md has its cost)",
    )

    def __post_init__(self) -> None:
        if self.cpu_affinity:
            from kvharbor.common.machine import parse_cpu_list

            parse_cpu_list(self.cpu_affinity)


Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (engine/kv/kv_handoff.py, engine/kv/kv_handoff_link.py)."""

    role: Role = opt(
        "both",
        "what the gateway sends here: both (whole requests), prefill (prompts whose KV a decode engine pulls), "
        "decode (whole requests, and requests whose prompt KV it pulls from a prefill engine)",
    )
    kv_transfer_port: int | None = opt(
        None, "TCP port decode engines pull hand-off KV blocks from (0: any free port; default: 0 for role prefill)"
    )
    kv_handoff_lease: float = opt(30.0, "seconds a prefill keeps its KV pinned for a decode engine that never confirms")
    kv_transfer_timeout: float = opt(30.0, "seconds a decode engine waits for one hand-off pull")
    kv_load_failure_policy: Literal["recompute", "fail"] = opt(
        "recompute", "a hand-off block that is missing or damaged: recompute its prefill here, or fail the request"
    )

    def __post_init__(self) -> None:
        if self.kv_transfer_port is not None and not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be in 0..65535, got {self.kv_transfer_port}")
        if self.kv_handoff_lease <= 0 or self.kv_transfer_timeout <= 0:
            raise ValueError("kv_handoff_lease and kv_transfer_timeout must be > 0 seconds")

    @property
    def transfer_port(self) -> int | None:
        """The port to serve hand-offs on (0: any), or None when this engine hands off nothing."""
        if self.kv_transfer_port is not None:
            return self.kv_transfer_port
        return 0 if self.role == "prefill" else None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora/adapter.py, engine/lora/lora_slots.py)."""

    lora: tuple[str, ...] = opt(
        (), "a LoRA adapter to serve, NAME=PATH (a PEFT folder: adapter_config.json + adapter_model.safetensors); "
        "requests ask for it by NAME in the model field"
    )
    enable_lora: bool = opt(False, "serve LoRA adapters (on by itself when --lora is given)")
    max_loras: int = opt(4, "most adapters one step runs (each takes a slot of max_lora_rank in memory)")
    max_lora_rank: int = opt(16, "highest adapter rank accepted (slots are sized for it)")
    max_cpu_loras: int = opt(8, "most adapters kept loaded; beyond max_loras they wait in memory, swapped in LRU")

    def __post_init__(self) -> None:
        from kvharbor.common.lora import parse_lora_spec

        names = [parse_lora_spec(spec)[0] for spec in self.lora]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora names must be unique, got {names}")
        if not 1 <= self.max_loras <= 64:
            raise ValueError(f"max_loras must be in 1..64, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in 1..512, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if len(names) > self.max_cpu_loras:
            raise ValueError(f"{len(names)} adapters given but max_cpu_loras is {self.max_cpu_loras}: raise it")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora)

    @property
    def adapters(self) -> list[tuple[str, str]]:
        from kvharbor.common.lora import parse_lora_spec

        return [parse_lora_spec(spec) for spec in self.lora]


@dataclass(frozen=True)
class StructuredConfig:
    """Compiling structured outputs (response_format, structured_outputs). Their size and nesting
    are request limits (common/request_limits.py); compilation is bounded by llguidance's fuel."""

    structured_cache_size: int = opt(256, "compiled grammars kept, keyed by a hash of the spec")
    structured_compile_timeout: float = opt(
        10.0, "seconds a request's grammar may take to compile (queued compiles included) before its 400"
    )

    def __post_init__(self) -> None:
        if self.structured_cache_size < 1:
            raise ValueError(f"structured_cache_size must be >= 1, got {self.structured_cache_size}")
        if not self.structured_compile_timeout > 0:
            raise ValueError(f"structured_compile_timeout must be > 0 seconds, got {self.structured_compile_timeout}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)


@dataclass(frozen=True)
class ServerConfig(TracedListenConfig):
    instance_id: str | None = opt(None, "this engine's id in KV events, /load and metrics (default: host-port)")
    redis_url: str | None = opt(
        None, "publish KV events to this Redis (redis://host:port/db, or redis+cluster://host:port for a cluster)"
    )
    kv_events_stream_prefix: str = opt(
        STREAM_PREFIX, "Redis key prefix of the per-instance KV event streams (and of their registry)"
    )
    lease_ttl: float = opt(10.0, "seconds an instance lease lives without a heartbeat")
    kv_store_push: Literal["all", "hot", "evict", "off"] = opt(
        "hot",
        "when to copy KV blocks into the shared block store in --redis-url: all (every filled block), "
        "hot (a prefix once it is reused here, and evicted blocks), evict (before a cached block is reused), off",
    )
    drain_timeout: float = opt(30.0, "seconds SIGTERM waits for in-flight requests before aborting them")
    max_waiting_requests: int = opt(
        256, "requests (a completions prompt list: each prompt) that may wait in this engine for their first token; "
        "429 beyond",
    )  # fmt: skip
    max_waiting_tokens: int = opt(
        262144, "prompt tokens that may wait in this engine for their first token; 429 beyond (a request alone is "
        "always taken)",
    )  # fmt: skip
    core_add_timeout: float = opt(
        60.0, "seconds the API server waits for its engine core to take a request (a grammar's compile and KV "
        "pulls included) before answering 504 (keep it above kv_transfer_timeout)",
    )  # fmt: skip
    api_server_nice: int = opt(
        10, "how much lower the API server's CPU priority is than its engine core's (0: the same; 0-19)"
    )
    slo_ttft_ms: float = opt(2000.0, "TTFT target (ms) for /load's slo_attainment")
    slo_itl_ms: float = opt(200.0, "mean inter-token latency target (ms) for /load's slo_attainment")
    slo_window: float = opt(60.0, "seconds of finished requests that slo_attainment covers")
    max_body_bytes: int = opt(4_000_000, "largest accepted request body (413 above)")
    allow_runtime_lora: bool = opt(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read server paths: keep them "
        "off a tenant-reachable port)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.api_server_nice <= 19:
            raise ValueError(f"api_server_nice must be in 0..19, got {self.api_server_nice}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_waiting_requests < 1 or self.max_waiting_tokens < 1:
            raise ValueError("max_waiting_requests and max_waiting_tokens must be >= 1")
        if not self.core_add_timeout > 0:
            raise ValueError(f"core_add_timeout must be > 0 seconds, got {self.core_add_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if min(self.slo_ttft_ms, self.slo_itl_ms, self.slo_window) <= 0:
            raise ValueError("slo_ttft_ms, slo_itl_ms and slo_window must be > 0")
        if self.lease_ttl <= 1:
            raise ValueError(f"lease_ttl must be > 1 second, got {self.lease_ttl}")
        if self.redis_url is not None:
            check_url(self.redis_url)  # a ValueError that says which URLs are accepted


@dataclass(frozen=True)
class ServeConfig:
    """`kvharbor serve`: the engine plus its HTTP server."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
