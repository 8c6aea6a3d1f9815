"""EngineCore: scheduler, block pool, runner, sampler and proposers; token ids in, token ids out.

proposals = proposer.propose(...)  # speculative decoding, when on: guesses for decoding requests
plan = scheduler.schedule()        # who runs, how many tokens, which blocks
out = runner.execute(plan)         # one forward pass + sampling
scheduler.update(plan, out)        # advance, fork n > 1, token-level stops
CoreOutputs                        # new token ids per sample (text is the output processor's)

It knows no text: detokenizing, stop strings and RequestOutputs belong to the output processor,
which tells the core where a stop string ended a sample (`stop_sample`). The offline LLMEngine
holds a core and runs both in one process; `kvharbor serve` runs the core in a process of its own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvharbor.common.block_hash import BlockHash, namespace_hash
from kvharbor.common.load_report import LoadReport
from kvharbor.common.machine import pin_to_cpus
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.attention_triton import resolve_backend
from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.capacity import KVCapacity, check_max_model_len, plan_capacity
from kvharbor.engine.config import EngineConfig, LoRAConfig
from kvharbor.engine.core_io import CoreOutput, EngineRequest, SampleDelta
from kvharbor.engine.decode_fit import DecodeFit
from kvharbor.engine.device import cpu_threads, resolve_device, resolve_dtype, set_cpu_threads
from kvharbor.engine.draft import draft_kv_bytes_per_token
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv_handoff import HandoffLeases
from kvharbor.engine.kv_transfer import KVBlockIO, weights_fingerprint
from kvharbor.engine.loader import LoadedModel, load_model
from kvharbor.engine.lora import AdapterError, LoRAAdapter, load_adapter
from kvharbor.engine.lora_manager import AdapterBusy, LoRAManager, UnknownAdapter, reserved_bytes
from kvharbor.engine.model import LlamaModel
from kvharbor.engine.proposers import AdaptiveK, NgramProposer, Proposal, Proposer
from kvharbor.engine.quantize import QuantWeight
from kvharbor.engine.request import FinishReason, Request, check_request_id
from kvharbor.engine.runner import ModelRunner
from kvharbor.engine.sampler import Sampler
from kvharbor.engine.sampling_params import SamplingParams
from kvharbor.engine.scheduler import Scheduler, SchedulerPlan, StepOutput

log = logging.getLogger("kvharbor.engine")
Progress = Callable[[str], None]


# What each --quantization mode keeps, for the start-up line.
QUANT_NOTES = {
    "int8": "linears, one scale per output channel; the LM head in int8 groups of 32 when its rows allow",
    "int4": "linears, 4 bits in groups of 32 with a scale and min each; the LM head in int8 groups of 32 when its "
    "rows allow",
    "gguf": "the file's own Q4_0/Q4_1/Q8_0 blocks, repacked",
}


@dataclass
class _Group:
    """One user request: n samples that share a prompt."""

    request_id: str
    params: SamplingParams
    samples: dict[int, Request] = field(default_factory=dict)
    reported: dict[int, int] = field(default_factory=dict)  # tokens already in a delta
    reported_finish: set[int] = field(default_factory=set)  # samples whose end was reported
    error: str | None = None
    hand_off: str | None = None  # a prefill for a decode engine: pin its prompt's KV under this key when it ends

    @property
    def finished(self) -> bool:
        # A request aborted or failed before its first token never forks its other samples.
        all_there = len(self.samples) == self.params.n or not self.samples[0].forked
        return all_there and all(r.is_finished for r in self.samples.values())


@dataclass
class EngineStats:
    """Measured speed, as EWMAs (alpha 0.2): the load report's 'prefill tok/s' and 'decode step',
    the decode batch and context tokens those steps ran, and how a decode step grows per sequence
    and per context token (engine/decode_fit.py; 0 until each has varied), which the gateway
    extrapolates to predict inter-token latency. The decode figures are reported
    from MIN_DECODE_STEPS steps on: a first few steps (cold caches, a neighbour's burst) once made
    an idle engine look twice as slow as a busy one, and the gateway kept a burst off it."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_batch: float = 0.0
    decode_context: float = 0.0  # context tokens of a decode step's sequences (EWMA)
    decode_steps: int = 0
    steps: int = 0
    spec_verifications: int = 0  # speculative chunks verified
    spec_proposed: int = 0  # draft tokens scored
    spec_accepted: int = 0  # of those, accepted
    kv_transfer_bytes_per_s: float = 0.0  # P/D pulls into this engine (EWMA)
    kv_transfer_at: float = 0.0  # time.monotonic() of the last pull measured (0: none yet)
    fit: DecodeFit = field(default_factory=DecodeFit)

    def record(self, plan: SchedulerPlan, seconds: float) -> None:
        prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 and not c.draft)
        self.steps += 1
        if prefill:
            rate = prefill / max(seconds, 1e-9)
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, rate)
            return
        batch, context = len(plan.chunks), sum(c.end for c in plan.chunks)
        self.decode_steps += 1
        self.decode_step_s = _ewma(self.decode_step_s, seconds)
        self.decode_batch = _ewma(self.decode_batch, float(batch))
        self.decode_context = _ewma(self.decode_context, float(context))
        self.fit.add(batch, context, seconds)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.kv_transfer_bytes_per_s = _ewma(self.kv_transfer_bytes_per_s, nbytes / seconds)
            self.kv_transfer_at = time.monotonic()

    def kv_transfer_age_s(self) -> float:
        """Seconds since a pull last measured the rate: the gateway trusts an old measure less
        (gateway/disagg.py pull_rate), or a pessimistic one would keep hand-offs, and so any new
        measure, away for good."""
        return round(time.monotonic() - self.kv_transfer_at, 1) if self.kv_transfer_at else 0.0

    def decode_report(self) -> dict[str, float]:
        """The load report's decode fields, once there are enough steps to tell (else none)."""
        if self.decode_steps < MIN_DECODE_STEPS:
            return {}
        per_seq, per_token = self.fit.slopes()
        return {
            "decode_step_ms": round(self.decode_step_s * 1000, 2),
            "decode_batch": round(self.decode_batch, 2),
            "decode_ms_per_seq": round(per_seq * 1000, 3),
            "decode_context_tokens": round(self.decode_context, 1),
            "decode_us_per_context_token": round(per_token * 1e6, 4),
        }


MIN_DECODE_STEPS = 8


def _ewma(old: float, new: float) -> float:
    return new if not old else 0.8 * old + 0.2 * new


class EngineCore:
    def __init__(
        self, config: EngineConfig, progress: Progress | None = None, loaded_model: LoadedModel | None = None
    ) -> None:
        """Load (or adopt `loaded_model`, whose tensors are copied, not changed), size the KV
        pool, warm up. `progress` receives one line per start-up phase."""
        say = progress or (lambda msg: log.info(msg))
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        pin_to_cpus(config.runtime.cpu_affinity)  # first: the thread count follows the CPUs left
        set_cpu_threads(self.device, config.runtime.threads)
        t0 = time.monotonic()
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
        check_max_model_len(config.model.max_model_len, self.arch.max_position_embeddings, self.model_name)
        say(
            f"building {self.arch.architecture} ({self.arch.num_parameters / 1e6:.1f}M parameters) "
            f"in {str(self.dtype).removeprefix('torch.')} on {self.device} ..."
        )
        self.model = LlamaModel(self.arch, self.dtype, self.device)
        self.model.load_hf_state_dict(
            {k: v if isinstance(v, QuantWeight) else v.to(self.dtype) for k, v in loaded.state_dict.items()}
        )
        fingerprint = weights_fingerprint(loaded.state_dict)
        del loaded
        threads = cpu_threads(self.device, config.runtime.threads)
        self.attention_backend = resolve_backend(
            config.runtime.attention_backend, self.device, config.cache.block_size, config.cache.kv_cache_dtype
        )
        self.batch_invariant = self._batch_invariant(threads)
        if config.model.quantization != "none":
            self._quantize(threads, say)
            fingerprint += "+" + config.model.quantization  # other weights: other KV, never imported
        if config.runtime.cpu_kernels and (fast := self.model.prepare_cpu_linears(threads, self.batch_invariant)):
            say(f"CPU linears: {fast}")
        self.weight_bytes = self.model.weight_bytes()
        self.draft_model = self._load_draft(config, say)
        self.loras, reserved = self._load_loras(config.lora, say, threads)
        shadow = draft_kv_bytes_per_token(self.draft_model, self.dtype) if self.draft_model is not None else 0
        self.capacity: KVCapacity = plan_capacity(
            self.arch, config.cache, self.dtype, self.device, config.model.max_model_len, shadow_bytes_per_token=shadow,
            reserved_bytes=reserved,
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
        )
        self.kv = KVCacheManager(self.pool)
        self.eos_token_ids = frozenset(self.arch.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer else ()
        )
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
            kv_dtype, self.batch_invariant,
        )  # fmt: skip
        self.kv_io = KVBlockIO(
            self.runner.kv_caches, self.capacity.block_size, self.model_name, fingerprint, kv_dtype, self.arch.head_dim
        )
        self.runner.kv_io = self.kv_io
        self.runner.lora = self.loras
        self.handoffs = HandoffLeases(self.kv, self.kv_io, config.disagg.kv_handoff_lease)
        self.kv_transfer_port = 0  # set by the core process once its hand-off server listens
        self.stats = EngineStats()
        self._groups: dict[str, _Group] = {}
        self._touched: set[str] = set()
        self.proposer, self.adaptive_k = self._speculation(config, say)
        say("warming up ...")
        self._warm_up()
        say(f"ready in {time.monotonic() - t0:.1f}s")

    # -- set-up -------------------------------------------------------------------------------

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
        path = "AVX2 kernels" if gemm is not None else "torch dequantize + matmul"
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
        from kvharbor.engine import cpu_kernels

        return cpu_kernels.load(threads)

    def _cpu_attention(self, threads: int):
        """The CPU kernels for decode attention, where they run (_cpu_gemm) with the torch backend,
        this model's head shape and a float32 or int8 cache (bfloat16 too in batch-invariant
        mode). None elsewhere."""
        a = self.arch
        if self.config.cache.kv_cache_dtype == "fp8":
            return None  # the kernel reads float32, bfloat16 and int8 rows; fp8 rows go through torch
        from kvharbor.engine import cpu_kernels

        if self.attention_backend != "torch" or not cpu_kernels.CpuKernels.takes_attention(
            a.num_heads, a.num_kv_heads, a.head_dim
        ):
            return None
        return self._cpu_gemm(threads, (torch.float32, torch.bfloat16) if self.batch_invariant else (torch.float32,))

    def _batch_invariant(self, threads: int) -> bool:
        """Whether this engine runs batch-invariant (--batch-invariant): `on` where it cannot
        raises ValueError saying why; `auto` is on wherever it can run, but for quantized weights."""
        mode = self.config.runtime.batch_invariant
        if mode == "off":
            return False
        if mode == "auto" and self.config.model.quantization != "none":
            # NOTE: invariant quantized linears keep every row on the int8-activation path, prefill
            # too: measured on the AMD EPYC Zen 4 (benchmarks/README.md), int8's top-1 fell from
            # 97.4% to 96.4% and gguf's mean KL rose 12x. `on` still runs it.
            log.info("batch-invariant mode off: quantized weights (--batch-invariant on forces it)")
            return False
        blocker = self._invariance_blocker(threads)
        if blocker is not None and mode == "on":
            raise ValueError(f"--batch-invariant on cannot run here: {blocker}; use --batch-invariant auto or off")
        if blocker is not None:
            log.info("batch-invariant mode off: %s", blocker)
        return blocker is None

    def _invariance_blocker(self, threads: int) -> str | None:
        """Why batch-invariant mode cannot run with this configuration, or None."""
        config, a = self.config, self.arch
        from kvharbor.engine import cpu_kernels

        if self.device.type != "cpu":
            return f"it runs on CPU only (kvharbor's kernels), not {self.device.type}"
        if not config.runtime.cpu_kernels:
            return "it needs --cpu-kernels"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return f"it runs float32 and bfloat16, not {str(self.dtype).removeprefix('torch.')}"
        if config.cache.kv_cache_dtype == "fp8":
            return "the kernels read no fp8 KV cache (use --kv-cache-dtype int8 or auto)"
        if config.lora.enabled:
            return "LoRA adapters' prefill deltas run through torch's products"
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
        from kvharbor.engine.draft import load_draft_model

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
            from kvharbor.engine.draft import DraftModelProposer, DraftSetup

            setup = DraftSetup(
                self.device, self.dtype, self.capacity.block_size, self.capacity.num_blocks,
                self.attention_backend, self.cpu_kernels, self.sampler.adjust,
            )  # fmt: skip
            proposer = DraftModelProposer(self.draft_model, setup)
        say(f"speculative decoding: {spec.speculative_method}, k={spec.speculative_k}")
        return proposer, AdaptiveK(spec.speculative_k)

    def _propose(self) -> dict[str, Proposal]:
        """Guesses for the running requests that decode this step and have not opted out."""
        if self.proposer is None:
            return {}
        decoding = [
            r for r in self.scheduler.running
            if r.forked and r.params.speculative and r.num_tokens - r.num_computed_tokens == 1
        ]  # fmt: skip
        ks = {r.request_id: self.adaptive_k.k_for(r) for r in decoding}
        return self.proposer.propose([r for r in decoding if ks[r.request_id]], ks)

    def _warm_up(self) -> None:
        # One short request through the whole path, so the first user does not pay for lazy
        # initialization (oneDNN kernels, allocator). Its blocks are dropped from the cache.
        warm = "warmup-" + os.urandom(4).hex()
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.add_request(EngineRequest(warm, [0] * min(8, self.max_model_len - 2), params))
        while self.has_unfinished():
            self.step()
        self.pool.reset_prefix_cache()
        self.pool.take_events()
        self.stats = EngineStats()

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for bad input; UnknownAdapter
        (a ValueError) when `req.lora` names no adapter this engine serves.

        P/D (engine/README.md): `req.hand_off` makes it a prefill for a decode engine (n=1): when
        it ends, its prompt's full KV blocks stay pinned under a lease of that key (self.handoffs;
        the API server draws one per prefill: engine/handoff_handles.py). `req.first_token`
        continues a prefill done elsewhere: that token is the first output, and only what the
        prefix cache lacks (the prompt's tail, once its blocks were imported) runs."""
        params, request_id, hand_off, first_token = req.params, req.request_id, req.hand_off, req.first_token
        params.validate()
        check_request_id(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._check_prompt(req.prompt_token_ids)
        if params.n > self.config.scheduler.max_n:
            raise ValueError(f"n={params.n} exceeds the engine's limit of {self.config.scheduler.max_n} (--max-n)")
        params.check_vocab(self.arch.vocab_size)
        self._check_handoff(params, hand_off, first_token)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but this model's context is {self.max_model_len}: "
                "shorten the prompt (at least one token must be generated)"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the {len(ids)}-token prompt exceeds the model's context "
                f"of {self.max_model_len} tokens: ask for at most {room}"
            )
        request = Request(
            request_id,
            ids,
            params,
            params.max_tokens or room,
            namespace_hash(self.model_name, req.cache_salt, self.adapter_identity(req.lora)),
            priority=req.priority,
            tenant=req.tenant,
            arrival_time=req.arrival_time,
            lora=req.lora,
        )
        self.scheduler.add(request)
        group = _Group(request_id, params, hand_off=hand_off)
        self._groups[request_id] = group
        self._register(group, request)
        if first_token is not None:
            request.append_output(first_token)
            self.scheduler.check_stop(request)  # the prefill's token may already end it
            self._touched.add(request_id)

    def adapter_identity(self, lora: str | None) -> str | None:
        """The KV identity of adapter `lora` (None: the base model); raises UnknownAdapter."""
        if lora is None:
            return None
        if self.loras is None:
            raise UnknownAdapter(f"adapter {lora!r} asked for, but this engine serves no LoRA adapters (--lora)")
        return self.loras.get(lora).identity

    # -- adapters (between steps) -------------------------------------------------------------

    def load_lora(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` (lora.load_adapter, read off the engine thread); raises AdapterError."""
        if self.loras is None:
            raise AdapterError("this engine serves no LoRA adapters: start it with --enable-lora or --lora")
        self.loras.add(adapter)
        log.info("LoRA adapter loaded", extra={"adapter": adapter.name, "rank": adapter.rank, "path": adapter.path})

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`. Raises UnknownAdapter, or AdapterError while requests use it."""
        if self.loras is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded: this engine serves no LoRA adapters")
        users = sum(1 for r in self.scheduler.requests.values() if r.lora == name)
        if users:
            raise AdapterBusy(f"adapter {name!r} has {users} requests in flight: retry when they are done")
        self.loras.remove(name)
        log.info("LoRA adapter unloaded", extra={"adapter": name})

    def _check_handoff(self, params: SamplingParams, hand_off: str | None, first_token: int | None) -> None:
        if hand_off is not None and not (isinstance(hand_off, str) and hand_off):
            raise ValueError(f"a hand-off names its lease with a non-empty string, not {hand_off!r}")
        held = hand_off and self.handoffs.size(hand_off) is not None
        if held or (hand_off and any(g.hand_off == hand_off for g in self._groups.values())):
            raise ValueError(f"the hand-off lease {hand_off!r} is already held: each prefill needs a key of its own")
        if (hand_off or first_token is not None) and params.n != 1:
            raise ValueError(f"a disaggregated request samples one sequence, not n={params.n}")
        if hand_off and first_token is not None:
            raise ValueError("a request is either a hand-off prefill or its continuation, not both")
        if first_token is not None and params.logprobs is not None:
            # NOTE: the first token's logprob was computed on the prefill engine; without it every
            # logprob reported here would sit one token off (they did, before this check).
            raise ValueError(
                "a hand-off continuation (first_token_id) reports no logprobs: send logprobs requests whole"
            )
        if first_token is not None and not (isinstance(first_token, int) and 0 <= first_token < self.arch.vocab_size):
            raise ValueError(f"first_token_id {first_token!r} is outside the vocabulary [0, {self.arch.vocab_size})")

    def _check_prompt(self, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            raise ValueError("a request needs a prompt or prompt_token_ids")
        ids = list(prompt_token_ids)
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.arch.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        return ids

    def _register(self, group: _Group, request: Request) -> None:
        group.samples[request.index] = request
        group.reported[request.index] = 0

    def abort(self, request_ids: str | list[str]) -> None:
        """Cancel requests (all their samples); their blocks go back to the pool at once. Unknown
        or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for request in group.samples.values():
                self.scheduler.finish(request, FinishReason.ABORT)
            self._touched.add(rid)

    def stop_sample(self, request_id: str, index: int, num_output_tokens: int, stop_string: str) -> None:
        """A stop string ended sample `index` of `request_id` after `num_output_tokens` outputs:
        retire it there (its blocks go back at once). Unknown or finished samples are ignored."""
        group = self._groups.get(request_id)
        request = group.samples.get(index) if group is not None else None
        if request is None:
            return
        self.scheduler.stop_at(request, num_output_tokens, stop_string)
        group.reported[index] = min(group.reported[index], num_output_tokens)
        self._touched.add(request_id)

    def has_unfinished(self) -> bool:
        # Pending imports count: their blocks are held until a step writes them.
        return self.scheduler.num_unfinished > 0 or bool(self._touched) or self.kv.has_loads

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Run one iteration. Returns an output for every request that progressed or finished."""
        self.handoffs.expire()
        plan = self.scheduler.schedule(self._propose())
        if plan.is_empty and self.scheduler.num_unfinished and not self.scheduler.running:
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_unfinished} requests waiting")
        if not plan.is_empty or plan.moves_kv:
            self._run(plan)
        self._hold_handoffs()
        outputs = [self._output(self._groups[g]) for g in sorted(self._touched) if g in self._groups]
        for rid in list(self._touched):
            group = self._groups.get(rid)
            if group is not None and group.finished:
                for request in group.samples.values():
                    self.sampler.forget(request)
                    if self.proposer is not None:
                        self.proposer.release(request)
                        self.adaptive_k.forget(request)
                del self._groups[rid]
        self._touched.clear()
        return outputs

    def _hold_handoffs(self) -> None:
        # In the step that finished them, before any later step could evict their blocks.
        for rid in self._touched:
            group = self._groups.get(rid)
            if group is None or not group.hand_off or not group.finished:
                continue
            lease, group.hand_off = group.hand_off, None
            request = group.samples[0]
            if group.error is None and request.finish_reason is not FinishReason.ABORT:
                full = request.num_prompt_tokens // self.capacity.block_size
                self.handoffs.hold(lease, request.full_block_hashes(self.capacity.block_size)[:full])

    def _run(self, plan: SchedulerPlan) -> None:
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(plan)
        except Exception as exc:
            self.kv.loaded(ok=False)
            self._fail(plan, exc)
            return
        self.kv.loaded()
        if plan.is_empty:
            return  # it only moved KV
        self.stats.record(plan, time.perf_counter() - t0)
        self._record_speculation(plan, out)
        forked = self.scheduler.update(plan, out)
        for child in forked:
            self._register(self._groups[child.group_id], child)
        for request in [c.request for c in plan.chunks] + forked:
            self._touched.add(request.group_id)

    def _record_speculation(self, plan: SchedulerPlan, out: StepOutput) -> None:
        for chunk in plan.chunks:
            if chunk.draft:
                accepted = len(out.tokens.get(chunk.request.request_id, [None])) - 1
                self.stats.spec_verifications += 1
                self.stats.spec_proposed += len(chunk.draft)
                self.stats.spec_accepted += accepted
                self.adaptive_k.record(chunk.request, len(chunk.draft), accepted)

    def _fail(self, plan: SchedulerPlan, exc: Exception) -> None:
        log.exception("engine step failed; failing its %d requests", len(plan.chunks))
        self.kv.uncache_blocks([c.request for c in plan.chunks])  # half-written KV: nobody may hit it
        # A user request fails whole: its samples that were not in this step fail with it.
        for group in {
            self._groups[c.request.group_id].request_id: self._groups[c.request.group_id] for c in plan.chunks
        }.values():
            group.error = f"{type(exc).__name__}: {exc}"
            for request in group.samples.values():
                self.scheduler.finish(request, FinishReason.ERROR)
            self._touched.add(group.request_id)

    def _output(self, group: _Group) -> CoreOutput:
        """The group's samples that moved since their last report: new tokens only."""
        samples = []
        for index, request in sorted(group.samples.items()):
            done = group.reported[index]
            new = request.output_token_ids[done:]
            reason = request.finish_reason.value if request.finish_reason else None
            if not new and ((done and reason is None) or index in group.reported_finish):
                continue  # a sibling that did not move this step, or whose end was already told
            group.reported[index] = len(request.output_token_ids)
            if reason is not None:
                group.reported_finish.add(index)
            stop = request.stop_reason if isinstance(request.stop_reason, int) else None
            logprobs = request.logprobs[done:] if group.params.logprobs is not None else []
            samples.append(SampleDelta(index, new, logprobs, reason, stop))
        first = group.samples[0]
        return CoreOutput(group.request_id, samples, group.finished, max(0, first.num_cached_tokens), group.error)

    def import_prefix(
        self, hashes: Sequence[BlockHash], payloads: Sequence[bytes], prefix: Sequence[BlockHash] = ()
    ) -> int:
        """Put KV blocks pulled from elsewhere into the prefix cache, as if computed here
        (KVCacheManager.import_blocks: `hashes` continues the chain `prefix`, `payloads[i]` is
        block i's KV in `kv_io.format`). The next step's runner writes them before its forward,
        so a request added after this call hits them. Returns how many blocks were imported."""
        return self.kv.import_blocks(hashes, payloads, prefix, self.kv_io.format.block_bytes)

    # -- introspection ------------------------------------------------------------------------

    def load(self) -> LoadReport:
        """The engine's part of the load report (DESIGN §2); the server adds its own fields."""
        waiting, running = self.scheduler.waiting, self.scheduler.running
        # Prompt tokens not computed yet, queued or mid-prefill: what a new request waits behind.
        prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*waiting, *running))
        stats = self.stats
        return LoadReport(
            model=self.model_name,
            running=len(running),
            waiting=len(waiting),
            waiting_prefill_tokens=prefill,
            context_tokens=sum(r.num_tokens for r in running),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.pool.num_cached,
            prefill_tokens_per_s=round(stats.prefill_tokens_per_s, 1),
            **stats.decode_report(),
            spec_acceptance_rate=round(stats.spec_accepted / stats.spec_proposed, 4) if stats.spec_proposed else None,
            weight_bytes=self.weight_bytes,
            kv_bytes_per_token=self.capacity.bytes_per_token,
            kv_format=self.kv_io.format.tag,
            block_size=self.capacity.block_size,
            role=self.config.disagg.role,
            kv_pinned_blocks=self.handoffs.num_blocks,
            kv_transfer_port=self.kv_transfer_port,
            kv_transfer_bytes_per_s=round(stats.kv_transfer_bytes_per_s, 1),
            kv_transfer_age_s=stats.kv_transfer_age_s(),
            **self._lora_report(),
        )

    def _lora_report(self) -> dict:
        if self.loras is None:
            return {}
        adapters = {name: a.identity for name, a in self.loras.adapters.items()}
        return {"lora_adapters": adapters, "lora_active": self.loras.active, "lora_slots": self.loras.slots.num_slots,
                "lora_bytes": self.loras.nbytes}  # fmt: skip

    def check_integrity(self) -> None:
        self.kv.check_integrity()
