"""What an EngineCore is made of, built in start-up order.

The counter board, pinning and threads, the model (loaded, or adopted and copied), its weights'
form (quantized, CPU linears), the batch-invariant decision, the draft model, LoRA slots, the KV
pool and its manager, the scheduler and sampler, the attention path, the runner, the KV I/O, the
queue of blocks saved for the shared store, the hand-off leases, and the proposer.
engine/core.py takes these parts over and is then requests and the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvharbor.common.machine import pin_to_cpus
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.config import EngineConfig, LoRAConfig
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.cpu import kernel_probe
from kvharbor.engine.kv.block_pool import BlockPool, SaveOn
from kvharbor.engine.kv.capacity import KVCapacity, check_max_model_len, plan_capacity
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv.kv_handoff import HandoffLeases
from kvharbor.engine.kv.kv_save import SAVE_ON, PushPolicy
from kvharbor.engine.kv.kv_transfer import weights_fingerprint
from kvharbor.engine.lora.adapter import load_adapter
from kvharbor.engine.lora.lora_manager import LoRAManager, reserved_bytes
from kvharbor.engine.model.attention_triton import resolve_backend
from kvharbor.engine.model.decoder import LlamaModel
from kvharbor.engine.model.device import cpu_threads, resolve_device, resolve_dtype, set_cpu_threads
from kvharbor.engine.model.loader import LoadedModel, load_model
from kvharbor.engine.pooling import resolve_pooling
from kvharbor.engine.quantize import QuantWeight
from kvharbor.engine.runner import ModelRunner
from kvharbor.engine.sampler import Sampler
from kvharbor.engine.scheduler import Scheduler
from kvharbor.engine.spec.draft import draft_kv_bytes_per_token
from kvharbor.engine.spec.proposers import AdaptiveK, NgramProposer, Proposer
from kvharbor.engine.structured.guides import GuideFactory

log = logging.getLogger("kvharbor.engine")
Progress = Callable[[str], None]


# What each --quantization mode keeps, for the start-up line.
QUANT_NOTES = {
    "int8": "linears, one scale per output channel; the LM head in int8 groups of 32 when its rows allow",
    "int4": "linears, 4 bits in groups of 32 with a scale and min each; the LM head in int8 groups of 32 when its "
    "rows allow",
    "gguf": "the file's own Q4_0/Q4_1/Q8_0 blocks, repacked",
}


class CoreParts:
    """An engine core's parts. Raises ValueError, saying what to change, for a configuration
    that cannot run (weights and --quantization, --batch-invariant on, --max-model-len)."""

    def __init__(
        self, config: EngineConfig, say: Progress, loaded_model: LoadedModel | None = None,
        kv_save: PushPolicy | None = None,
    ) -> None:
        self.config = config
        self.board = CounterBoard()
        self.device = resolve_device(config.model.device)
        pin_to_cpus(config.runtime.cpu_affinity)  # first: the thread count follows the CPUs left
        set_cpu_threads(self.device, config.runtime.threads)
        threads = cpu_threads(self.device, config.runtime.threads)
        self.dtype = self._dtype(threads, say)
        fingerprint = self._build_model(loaded_model, say)
        self.attention_backend = resolve_backend(
            config.runtime.attention_backend, self.device, config.cache.block_size, config.cache.kv_cache_dtype,
            self.arch.attention_features,
        )  # fmt: skip
        self.batch_invariant = self._batch_invariant(threads)
        if config.model.quantization != "none":
            self._quantize(threads, say)
            fingerprint += "+" + config.model.quantization  # other weights: other KV, never imported
        if config.runtime.cpu_kernels and (fast := self.model.prepare_cpu_linears(threads, self.batch_invariant)):
            say(f"CPU linears: {fast}")
        self.weight_bytes = self.model.weight_bytes()
        self.draft_model = self._load_draft(config, say)
        self.loras, reserved = self._load_loras(config.lora, say, threads)
        save_on = SAVE_ON[kv_save or "off"]
        self._size_kv(reserved, say, save_on)
        self._build_step(threads, fingerprint, say, save_blocks=bool(save_on))
        self.proposer, self.adaptive_k = self._speculation(config, say)

    def _dtype(self, threads: int, say: Progress) -> torch.dtype:
        """The engine's dtype; `auto` on CPU with float weights as the start-up probe measured it
        (engine/cpu/kernel_probe.py), where kvharbor's kernels run."""
        model, runtime = self.config.model, self.config.runtime
        quantized = model.quantization != "none"
        measured = None
        if model.dtype == "auto" and self.device.type == "cpu" and not quantized and runtime.cpu_kernels:
            say("dtype auto: timing float32 and bfloat16 linears on this CPU ...")
            # Invariant unless turned off, or (auto) the configuration alone will turn it off.
            mode = runtime.batch_invariant
            off = mode == "off" or (mode == "auto" and self._config_blocker() is not None)
            choice = kernel_probe.probed(threads, not off)
            if choice is not None:
                measured = choice.dtype
                say(f"dtype auto: {choice.dtype} ({choice.why})")
        return resolve_dtype(model.dtype, self.device, quantized=quantized, measured=measured)

    def _build_model(self, loaded_model: LoadedModel | None, say: Progress) -> str:
        """Loads (or adopts: its tensors are copied, not changed) the weights into a LlamaModel in
        the engine's dtype. Returns the weights' fingerprint (what imported KV must match)."""
        config = self.config
        if loaded_model is None:
            say(f"loading model {config.model.model or '(bundled SmolLM2-135M-Instruct)'} ...")
        blocks = config.model.quantization == "gguf"
        loaded = loaded_model or load_model(config.model.model, config.model.served_model_name, keep_blocks=blocks)
        kept = any(isinstance(v, QuantWeight) for v in loaded.state_dict.values())
        if blocks and not kept:
            raise ValueError(
                "--quantization gguf needs the model's GGUF blocks, and these weights are float "
                "(a Hugging Face folder, or a model loaded without keep_blocks): use int8 or int4"
            )
        if kept and not blocks:
            raise ValueError(
                f"these weights were loaded with their GGUF blocks kept, which only --quantization gguf runs "
                f"(asked: {config.model.quantization}): load them without keep_blocks"
            )
        self.model_name = loaded.name
        self.arch = loaded.arch
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        # None: it generates; else its requests pool (engine/pooling.py)
        self.pooling = resolve_pooling(loaded.path, config.model.task, config.model.pooling)
        check_max_model_len(config.model.max_model_len, self.arch.context_limit, self.model_name)
        say(
            f"building {self.arch.architecture} ({self.arch.num_parameters / 1e6:.1f}M parameters) "
            f"in {str(self.dtype).removeprefix('torch.')} on {self.device} ..."
        )
        self.model = LlamaModel(self.arch, self.dtype, self.device)
        self.model.load_hf_state_dict(
            {k: v if isinstance(v, QuantWeight) else v.to(self.dtype) for k, v in loaded.state_dict.items()}
        )
        return weights_fingerprint(loaded.state_dict)

    def _size_kv(self, reserved: int, say: Progress, save_on: frozenset[SaveOn]) -> None:
        """The KV pool from what memory is left (minus a draft model's shadow cache and LoRA's
        reservation), its block pool (recording blocks to copy out on `save_on`) and cache manager."""
        config = self.config
        shadow = draft_kv_bytes_per_token(self.draft_model, self.dtype) if self.draft_model is not None else 0
        self.capacity: KVCapacity = plan_capacity(
            self.arch, config.cache, self.dtype, self.device, config.model.max_model_len, shadow_bytes_per_token=shadow,
            reserved_bytes=reserved, step_tokens=config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.max_model_len = self.capacity.max_model_len
        say(
            f"KV pool: {self.capacity.num_blocks} blocks x {self.capacity.block_size} tokens = "
            f"{self.capacity.capacity_tokens} tokens ({self.capacity.total_bytes / 2**20:.0f} MiB, "
            f"{self.capacity.bytes_per_token} bytes/token)"
        )
        if self.capacity.capped:
            log.warning(self.capacity.cap_note())
        self.pool = BlockPool(
            self.capacity.num_blocks,
            self.capacity.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            enable_events=config.cache.kv_events,
            save_on=save_on,
        )
        self.kv = KVCacheManager(self.pool, window=self.arch.kv_window)

    def _build_step(self, threads: int, fingerprint: str, say: Progress, save_blocks: bool) -> None:
        """The scheduler, the sampler, the attention path, the runner, its KV I/O and save queue,
        the hand-off leases and the grammars."""
        config = self.config
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.eos_token_ids = frozenset(self.arch.eos_token_ids) | frozenset(tokenizer_eos)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.eos_token_ids, self.loras)
        self.sampler = Sampler(self.arch.vocab_size, self.eos_token_ids, config.model.engine_seed)
        say(f"attention backend: {self.attention_backend}")
        self.cpu_kernels = self._cpu_attention(threads)
        if self.batch_invariant:
            say("batch-invariant: every row's attention and linears through kvharbor's CPU kernels")
        elif self.cpu_kernels is not None:
            say("decode attention: AVX2 kernel over the paged cache")
        kv_dtype = config.cache.kv_cache_dtype
        self.runner = ModelRunner(
            self.model, self.kv, self.sampler, self.dtype, self.device, self.attention_backend, self.cpu_kernels,
            kv_dtype, self.batch_invariant, self.loras, (self.model_name, fingerprint), save_blocks, self.board,
        )  # fmt: skip
        self.kv_io = self.runner.kv_io
        self.kv_saves = self.runner.saves
        self.handoffs = HandoffLeases(self.kv, self.kv_io, config.disagg.kv_handoff_lease)
        self.guides = GuideFactory(self.tokenizer, self.arch.vocab_size, self.eos_token_ids, config.structured,
                                   config.limits, self._compiled)  # fmt: skip

    def _compiled(self, seconds: float, hit: bool) -> None:
        self.board.inc("structured_compiles", label="hit" if hit else "miss")
        self.board.inc("structured_compile_seconds", seconds)

    def _quantize(self, threads: int, say: Progress) -> None:
        """Quantize (or adopt GGUF blocks), through the AVX2 kernels where they run (CPU, float32 or
        bfloat16 rows widened for them), else through torch's dequantize-and-matmul, which saves
        the memory but not the time."""
        mode = self.config.model.quantization
        gemm = self._cpu_gemm(threads, (torch.float32, torch.bfloat16))
        if gemm is None:
            here = f"{str(self.dtype).removeprefix('torch.')} on {self.device}"
            log.warning(
                "--quantization %s on %s runs through torch's dequantize-and-matmul: the memory of %s weights, "
                "but slower than unquantized (the fast kernels need a CPU with AVX2, float32 or bfloat16, and "
                "--cpu-kernels)",
                mode, here, mode,
            )  # fmt: skip
        say("repacking the GGUF blocks ..." if mode == "gguf" else f"quantizing the linear layers to {mode} ...")
        nbytes = self.model.quantize(gemm, mode, self.batch_invariant)
        path = "torch dequantize + matmul" if gemm is None else "AVX2 kernels"
        if gemm is not None and gemm.int_packs():
            path = "packed integer GEMM, AVX512-VNNI, 16-bit activations"
        say(f"{mode} weights: {nbytes / 2**20:.0f} MiB ({QUANT_NOTES[mode]}; {path})")

    def _load_loras(self, lora: LoRAConfig, say: Progress, threads: int) -> tuple[LoRAManager | None, int]:
        """The adapter slots and the --lora adapters, and the bytes LoRA reserves of the KV budget."""
        if not lora.enabled:
            return None, 0
        manager = LoRAManager(
            self.arch, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, self.dtype, self.device,
            self._cpu_gemm(threads, (torch.float32, torch.bfloat16)),  # lora_decode takes both
        )  # fmt: skip
        for name, path in lora.adapters:
            say(f"loading LoRA adapter {name} from {path} ...")
            manager.add(load_adapter(name, path, self.arch, lora.max_lora_rank))
        element = torch.empty((), dtype=self.dtype).element_size()
        reserved = reserved_bytes(self.arch, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, element)
        say(
            f"LoRA: {lora.max_loras} slots of rank {lora.max_lora_rank}, up to {lora.max_cpu_loras} adapters "
            f"loaded ({len(manager.adapters)} now); {reserved / 2**20:.0f} MiB reserved of the KV budget"
        )
        return manager, reserved

    def _cpu_gemm(self, threads: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
        """The AVX2 kernels (cpu_kernels.CpuKernels) where they run: a model dtype in `dtypes` on
        the CPU, with --cpu-kernels, on a CPU they were built for. None elsewhere."""
        if not (self.config.runtime.cpu_kernels and self.device.type == "cpu" and self.dtype in dtypes):
            return None
        from kvharbor.engine.cpu import cpu_kernels

        return cpu_kernels.load(threads)

    def _cpu_attention(self, threads: int):
        """The CPU kernels for decode attention, where they run (_cpu_gemm) with the torch backend,
        this model's head shape and a float32 or int8 cache (bfloat16 too in batch-invariant
        mode). None elsewhere."""
        a = self.arch
        if self.config.cache.kv_cache_dtype == "fp8":
            return None  # the kernel reads float32, bfloat16 and int8 rows; fp8 rows go through torch
        from kvharbor.engine.cpu import cpu_kernels

        if self.attention_backend != "torch" or not cpu_kernels.CpuKernels.takes_attention(
            a.num_heads, a.num_kv_heads, a.head_dim
        ):
            return None
        return self._cpu_gemm(threads, (torch.float32, torch.bfloat16) if self.batch_invariant else (torch.float32,))

    def _batch_invariant(self, threads: int) -> bool:
        """Whether this engine runs batch-invariant (--batch-invariant): `on` where it cannot
        raises ValueError saying why; `auto` is on wherever it can run, but for quantized weights
        that do not all run on the packed integer GEMM (_packs_quantized)."""
        mode = self.config.runtime.batch_invariant
        if mode == "off":
            return False
        if mode == "auto" and self.config.model.quantization != "none" and not self._packs_quantized(threads):
            # NOTE: without AVX512-VNNI, invariant quantized linears keep every row on the integer
            # tiles' int8 activations, prefill too: measured on the AMD EPYC Zen 4
            # (benchmarks/README.md), int8's top-1 fell from 97.4% to 96.4% and gguf's mean KL rose
            # 12x. With it, both modes run the packed integer GEMM's 16-bit activations (engine/
            # quantize.py), so the mode costs nothing there. `on` still runs it.
            log.info("batch-invariant mode off: quantized weights off the packed integer GEMM (no AVX512-VNNI, or a "
                     "width that is not a multiple of 32; --batch-invariant on forces it)")
            return False
        blocker = self._invariance_blocker(threads)
        if blocker is not None and mode == "on":
            raise ValueError(f"--batch-invariant on cannot run here: {blocker}; use --batch-invariant auto or off")
        if blocker is not None:
            log.info("batch-invariant mode off: %s", blocker)
        return blocker is None

    def _packs_quantized(self, threads: int) -> bool:
        """Whether every quantized projection runs on the packed integer GEMM here (quantize.packs:
        AVX512-VNNI, and an input width of whole groups; int8 weights may have others, which stay
        on the integer tiles, 4x slower in 32-row slices)."""
        if self.device.type != "cpu" or not self.config.runtime.cpu_kernels:
            return False
        from kvharbor.engine.cpu import cpu_kernels
        from kvharbor.engine.quantize import packs

        kernels, a = cpu_kernels.load(threads), self.arch
        return all(packs(kernels, k) for k in (a.hidden_size, a.num_heads * a.head_dim, a.intermediate_size))

    def _config_blocker(self) -> str | None:
        """What in the configuration alone keeps batch-invariant mode from running (known before
        the model loads, so the dtype probe can ask), or None."""
        if self.config.cache.kv_cache_dtype == "fp8":
            return "the kernels read no fp8 KV cache (use --kv-cache-dtype int8 or auto)"
        if self.config.lora.enabled:
            return "LoRA adapters' prefill deltas run through torch's products"
        return None

    def _invariance_blocker(self, threads: int) -> str | None:
        """Why batch-invariant mode cannot run with this configuration, or None."""
        config, a = self.config, self.arch
        from kvharbor.engine.cpu import cpu_kernels

        if self.device.type != "cpu":
            return f"it runs on CPU only (kvharbor's kernels), not {self.device.type}"
        if not config.runtime.cpu_kernels:
            return "it needs --cpu-kernels"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return f"it runs float32 and bfloat16, not {str(self.dtype).removeprefix('torch.')}"
        if blocker := self._config_blocker():
            return blocker
        if self.attention_backend != "torch":
            return f"it runs on the torch attention backend, not {self.attention_backend}"
        if not cpu_kernels.CpuKernels.takes_attention(a.num_heads, a.num_kv_heads, a.head_dim):
            heads = f"{a.num_heads} heads / {a.num_kv_heads} KV heads / dim {a.head_dim}"
            return f"the attention kernel does not take {heads}"
        if cpu_kernels.load(threads) is None:
            return "kvharbor's CPU kernels do not run on this machine (x86-64 with AVX2 + FMA and a C compiler)"
        return None

    def _load_draft(self, config: EngineConfig, say: Progress) -> LlamaModel | None:
        spec = config.speculative
        if spec.speculative_method != "draft":
            return None
        from kvharbor.engine.spec.draft import load_draft_model

        say(f"loading draft model {spec.draft_model} ...")
        threads = cpu_threads(self.device, config.runtime.threads) if config.runtime.cpu_kernels else None
        return load_draft_model(spec.draft_model, self.arch, self.dtype, self.device, threads)

    def _speculation(self, config: EngineConfig, say: Progress) -> tuple[Proposer | None, AdaptiveK | None]:
        spec = config.speculative
        if spec.speculative_method == "off":
            return None, None
        if spec.speculative_method == "ngram":
            proposer: Proposer = NgramProposer(spec.ngram_n)
        else:
            from kvharbor.engine.spec.draft import DraftModelProposer, DraftSetup

            setup = DraftSetup(
                self.device, self.dtype, self.capacity.block_size, self.capacity.num_blocks,
                self.attention_backend, self.cpu_kernels, self.sampler.adjust,
            )  # fmt: skip
            proposer = DraftModelProposer(self.draft_model, setup)
        say(f"speculative decoding: {spec.speculative_method}, k={spec.speculative_k}")
        return proposer, AdaptiveK(spec.speculative_k)
