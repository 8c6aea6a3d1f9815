"""The Llama-family decoder (Llama, Mistral, SmolLM2, Qwen2/3, Phi-3, Gemma 2/3) over a flat,
unpadded token batch.

Every non-attention op sees one `[num_tokens, hidden]` matrix; attention reads the paged KV cache
(engine.attention). Q/K/V and gate/up projections are fused into one matmul each, because on CPU
the per-op overhead of 30 layers x a dozen ops is what a decode step is made of.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvharbor.engine.cpu import cpu_linear
from kvharbor.engine.cpu.layer_ops import CPU_MAX_ROWS, CpuOps, TorchOps
from kvharbor.engine.model.arch import ModelArch
from kvharbor.engine.model.attention import AttentionMetadata, paged_attention
from kvharbor.engine.model.rope import base_inv_freq, rope_extension, rope_inv_freq
from kvharbor.engine.quantize import QuantWeight, concat

if TYPE_CHECKING:  # a step's adapters, passed in by the runner: lora/ builds on the model, not under it
    from kvharbor.engine.lora.lora_slots import LoRAStep

# Rows up to which quantized projections go through the kernel on their quantized bytes; larger
# inputs are dequantized a slice at a time for MKL. Measured on the AMD EPYC (2 threads,
# SmolLM2's four projection shapes): the int8 and int4 kernels ran at 1.3x / 1.0x of
# dequantize-plus-MKL at 32 rows and 0.9x / 0.75x at 64.
QUANT_MAX_ROWS = 32
QUANT_MAX_ROWS_WIDE = 64  # the LM head: dequantizing its 49,152 rows costs more


def _release(param: torch.Tensor) -> None:
    """Drop a parameter's storage, keeping its dtype and device: a packed or quantized copy holds
    its weights now."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _linear(x: torch.Tensor, weight: torch.Tensor, fast: cpu_linear.FastLinear | None, bias=None) -> torch.Tensor:
    return F.linear(x, weight, bias) if fast is None else fast(x, bias)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, index: int = 0) -> None:
        super().__init__()
        self.index = index
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.eps = arch.rms_norm_eps
        self.attention = arch.attention(index)
        self.local_rope = self.attention.window is not None and arch.local_rope_theta is not None
        self.act = arch.hidden_act
        qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * d
        # Gemma's norms multiply by (1 + w) in float32: kept as float32 1 + w (load_hf_state_dict)
        norm_dtype = torch.float32 if arch.norm_plus_one else dtype
        self.input_norm = _param(h, dtype=norm_dtype, device=device)
        self.qkv = _param(qkv_rows, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_rows, dtype=dtype, device=device) if arch.attention_bias else None
        self.o_proj = _param(h, arch.num_heads * d, dtype=dtype, device=device)
        self.post_norm = _param(h, dtype=norm_dtype, device=device)  # before the MLP
        # Gemma's sandwich: the attention's and the MLP's outputs normed before the residual add
        self.attn_out_norm = _param(h, dtype=norm_dtype, device=device) if arch.sandwich_norms else None
        self.mlp_out_norm = _param(h, dtype=norm_dtype, device=device) if arch.sandwich_norms else None
        # Qwen3, Gemma 3: each query and key head RMS-normed before RoPE (weights over head_dim)
        self.q_norm = _param(d, dtype=norm_dtype, device=device) if arch.qk_norm else None
        self.k_norm = _param(d, dtype=norm_dtype, device=device) if arch.qk_norm else None
        self.gate_up = _param(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down = _param(h, arch.intermediate_size, dtype=dtype, device=device)
        self.fast: dict[str, cpu_linear.FastLinear | None] = dict.fromkeys(("qkv", "o_proj", "gate_up", "down"))
        self.blocks: dict[str, QuantWeight] = {}  # projections loaded as GGUF blocks, until quantize()

    def prepare(self, make) -> None:
        """Give every projection its CPU fast path (see engine/cpu/cpu_linear.py); call after loading.
        Projections that have one already (quantized) keep it."""
        for name, fast in self.fast.items():
            if fast is None:
                weight = getattr(self, name)
                self.fast[name] = fast = make(weight.data)
                if getattr(fast, "owns_weight", False):  # a packed copy: the only one kept
                    _release(weight)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, kv_heads, slots, dim]
        meta: AttentionMetadata,
        ops: TorchOps,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = ops.add_rms_norm(x, residual, self.input_norm, self.eps)
        qkv = _linear(h, self.qkv, self.fast["qkv"], self.qkv_bias)
        if lora is not None:
            lora.apply(self.index, "qkv", h, qkv)
        t = qkv.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is not None:
            ops.head_norm(qkv, nq, nkv, d, self.q_norm, self.k_norm, self.eps)
        q, k = ops.rope(qkv, nq, nkv, d, cos, sin)
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        attn = paged_attention(q, k, v, kv_cache, meta, self.attention)
        attn = attn.reshape(t, nq * d)
        o = _linear(attn, self.o_proj, self.fast["o_proj"])
        if lora is not None:
            lora.apply(self.index, "o_proj", attn, o)
        if self.attn_out_norm is not None:
            o = ops.add_rms_norm(o, None, self.attn_out_norm, self.eps)[0]
        h, residual = ops.add_rms_norm(o, residual, self.post_norm, self.eps)
        gate_up = _linear(h, self.gate_up, self.fast["gate_up"])
        if lora is not None:
            lora.apply(self.index, "gate_up", h, gate_up)
        act = ops.silu_mul(gate_up) if self.act == "silu" else ops.gelu_tanh_mul(gate_up)
        out = _linear(act, self.down, self.fast["down"])
        if lora is not None:
            lora.apply(self.index, "down", act, out)
        if self.mlp_out_norm is not None:
            out = ops.add_rms_norm(out, None, self.mlp_out_norm, self.eps)[0]
        return out, residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.embed = _param(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, device, i) for i in range(arch.num_layers))
        self.norm = _param(arch.hidden_size, dtype=torch.float32 if arch.norm_plus_one else dtype, device=device)
        self.lm_head = (
            self.embed
            if arch.tie_word_embeddings
            else _param(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(arch).to(device), persistent=False)
        long, self.rope_switch, self.rope_scale = rope_extension(arch)
        self.register_buffer("inv_freq_long", None if long is None else long.to(device), persistent=False)
        local = None if arch.local_rope_theta is None else base_inv_freq(arch.local_rope_theta, arch.head_dim)
        self.register_buffer("inv_freq_local", None if local is None else local.to(device), persistent=False)
        self.embed_scale = arch.hidden_size**0.5 if arch.embed_scale else None
        self.lm_head_fast: cpu_linear.FastLinear | None = None
        self.embed_packed = None  # a tied embedding read from the LM head's packed copy (_release_head)
        # GGUF blocks kept as they are (--quantization gguf) for the embedding and the LM head.
        self.embed_blocks: QuantWeight | None = None
        self.head_blocks: QuantWeight | None = None
        self.ops = TorchOps()  # the layers' pointwise ops (engine/cpu/layer_ops.py)
        # The residual stream's and the projections' dtype: the model's, or float32 in
        # batch-invariant mode (prepare_cpu_linears), where the kernels take float32 rows.
        self.activation_dtype = dtype
        self.head: cpu_linear.FastLinear | None = None  # float32 logits (cpu_linear.float32_head), set on first use

    def prepare_cpu_linears(self, threads: int, invariant: bool = False) -> str | None:
        """Give the projections and the LM head the CPU fast path for this dtype, if there is one
        (engine/cpu/cpu_linear.py), and the layers the AVX2 kernels' pointwise ops where those run
        (float32 on CPU, engine/cpu/layer_ops.py). `invariant`: batch-invariant paths only (every row
        count through the same kernels; ValueError where they cannot run). Returns what it is, or
        None. Batch-invariant projections keep only their packed copy (cpu_linear.PackedLinear); other
        weights stay as they are."""
        dtype, device = self.embed.dtype, self.embed.device
        kernels = None
        if device.type == "cpu":
            from kvharbor.engine.cpu import cpu_kernels

            kernels = cpu_kernels.load(threads)
        if kernels is not None and (dtype == torch.float32 or invariant):
            self.ops = CpuOps(kernels, None if invariant else CPU_MAX_ROWS)
            # NOTE: batch-invariant bfloat16 keeps bfloat16 weights and KV but float32 activations:
            # the kernels take float32 rows anyway (on AVX512-BF16 a projection rounds its input
            # rows to bfloat16 itself, each element alone), and torch's bfloat16 pointwise ops are
            # not batch-invariant (their vectorized loops' scalar tails move with the size).
            self.activation_dtype = torch.float32
        weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        chosen = cpu_linear.prepare_linears(dtype, device, threads, weight_bytes, invariant)
        if chosen is not None:
            for layer in self.layers:
                layer.prepare(chosen.make)
            if dtype == torch.float32 or invariant:  # a float32 head either way
                self.lm_head_fast = self.lm_head_fast or chosen.make_head(self.lm_head.data)
                if getattr(self.lm_head_fast, "owns_weight", False):
                    self._release_head(self.lm_head_fast.weight)
        self.head = cpu_linear.float32_head(self.lm_head.data, self.lm_head_fast, kernels)
        return chosen.what if chosen is not None else None

    def quantize(self, gemm, mode: str, invariant: bool = False) -> int:
        """Run every projection from a quantized weight (engine/quantize.py) through `gemm`
        (cpu_kernels.CpuKernels; None: torch's dequantize-and-matmul), releasing the float
        copies. Projections loaded as GGUF blocks (mode gguf) keep those; float ones are quantized
        to `mode` (int8, int4). The LM head (and a tied embedding) is kept as loaded in gguf, and
        made q8 (int8 groups of 32) in int8 and int4 (engine/quantize.py says why). Norms stay float.
        Call before prepare_cpu_linears (which then leaves them). `invariant`: batch-invariant
        products (QuantLinear). Returns the quantized bytes."""
        from kvharbor.engine.quantize import QuantLinear, quantize

        total = 0
        for layer in self.layers:
            for name in layer.fast:
                weight = getattr(layer, name)
                qw = (layer.blocks.pop(name, None) or quantize(weight.data.float(), mode)).to(self.embed.device)
                layer.fast[name] = fast = QuantLinear(gemm, qw, QUANT_MAX_ROWS, invariant)
                _release(weight)  # only the quantized copy stays
                total += fast.nbytes
        return total + self._quantize_head(gemm, mode, invariant)

    def _quantize_head(self, gemm, mode: str, invariant: bool) -> int:
        from kvharbor.engine.quantize import GROUP, QuantLinear, quantize_q8

        device, tied = self.embed.device, self.arch.tie_word_embeddings
        if self.head_blocks is None and mode in ("int8", "int4") and self.arch.hidden_size % GROUP == 0:
            self.head_blocks = quantize_q8(self.lm_head.data.float())
            if tied:
                self.embed_blocks = self.head_blocks
        if self.embed_blocks is not None:
            self.embed_blocks = self.embed_blocks.to(device)
        if self.head_blocks is not None:
            self.head_blocks = self.embed_blocks if tied else self.head_blocks.to(device)
        total = 0
        if self.head_blocks is not None:
            self.lm_head_fast = head = QuantLinear(gemm, self.head_blocks, QUANT_MAX_ROWS_WIDE, invariant)
            _release(self.lm_head)
            if head.int_packed is not None:  # its packed copy alone is kept; a tied embedding reads it
                self.embed_packed = head.int_packed if tied else None
                self.embed_blocks = None if tied else self.embed_blocks
                self.head_blocks = None
                total += head.nbytes
            elif self.embed_blocks is not self.head_blocks:
                total += self.head_blocks.nbytes
        if self.embed_blocks is not None or self.embed_packed is not None:
            _release(self.embed)
        if self.embed_blocks is not None:
            total += self.embed_blocks.nbytes
        return total

    def weight_bytes(self) -> int:
        """Bytes of weights held: float parameters, quantized weights at their own size, and any
        packed copy a fast path keeps for prefill."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        fasts = [f for layer in self.layers for f in layer.fast.values()] + [self.lm_head_fast]
        for fast in fasts:
            total += getattr(fast, "nbytes", 0)
            if (packed := getattr(fast, "packed", None)) is not None:
                total += packed.numel() * packed.element_size()
        if self.embed_blocks is not None and self.embed_blocks is not self.head_blocks:
            total += self.embed_blocks.nbytes  # the tied case counts once, as the LM head
        return total

    def _release_head(self, packed) -> None:
        """Keep only the LM head's packed copy (cpu_kernels.PackedWeight); a tied embedding then
        reads its rows from it."""
        if self.arch.tie_word_embeddings:
            self.embed_packed = packed
            _release(self.embed)
        else:
            _release(self.lm_head)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden], unpacked again if only a packed copy is kept."""
        packed = getattr(self.lm_head_fast, "weight", None)
        return packed.unpack() if self.lm_head.numel() == 0 and hasattr(packed, "unpack") else self.lm_head

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_packed is not None:  # the LM head's packed copy (float or quantized)
            return self.embed_packed.rows(input_ids).to(self.embed.dtype)
        if self.embed_blocks is None:
            return F.embedding(input_ids, self.embed)
        return self.embed_blocks.dequantize(input_ids).to(self.embed.dtype)  # only the rows asked for

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions`, [T, 1, head_dim/2]: the angles in float32 like the reference,
        their cos/sin in float64 rounded to float32. NOTE: torch's float32 cos/sin take a vector
        path and a scalar tail that can differ by an ulp, and which positions fall in the tail
        depends on T: float64 rounded to float32 gives a position the same value in any batch."""
        inv_freq = self.inv_freq_local if local else self.inv_freq  # local: Gemma 3's sliding layers, unscaled
        freqs = (positions.float()[:, None] * inv_freq[None, :]).double()
        if self.inv_freq_long is not None and not local:
            long = (positions.float()[:, None] * self.inv_freq_long[None, :]).double()
            freqs = torch.where((positions >= self.rope_switch)[:, None], long, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale != 1.0 and not local:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,  # [layers, 2, kv_heads, slots, dim]
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm; K/V written into `kv_caches`. `lora`:
        the step's adapter rows (engine/lora/lora_slots.py), None when every row is the base model's."""
        x = self._embed(input_ids)
        if self.embed_scale is not None:  # in the embedding's dtype, as HF's Gemma rounds it
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        x = x.to(self.activation_dtype)
        ropes = {False: self.rope(positions, x.dtype)}
        if self.inv_freq_local is not None:
            ropes[True] = self.rope(positions, x.dtype, local=True)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = ropes[layer.local_rope]
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, self.ops, lora)
        return x.float() + residual  # float32, for the final norm (logits())

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 hidden rows after the final norm: what an embedding pools (engine/pooling.py),
        as transformers' `last_hidden_state`."""
        return F.rms_norm(hidden.float(), (hidden.shape[-1],), self.norm.float(), self.arch.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the selected hidden rows. NOTE: the final norm and the
        LM head run in float32 whatever the model dtype (HF rounds both to the model dtype): a
        logit rounded to bfloat16 moves by up to 0.06 at ~25, enough to tie or swap the top two
        tokens, and ties then go to the lower token id."""
        h = F.rms_norm(hidden.float(), (hidden.shape[-1],), self.norm.float(), self.arch.rms_norm_eps)
        if self.head is None:
            self.head = cpu_linear.float32_head(self.lm_head.data, self.lm_head_fast, None)
        logits = self.head(h, None)
        if (cap := self.arch.final_softcap) is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face Llama/Qwen2 checkpoints, fusing q/k/v and
        gate/up. Raises ValueError naming the first missing or misshapen tensor. Weights given as
        QuantWeight (GGUF blocks) are kept, not copied: quantize() must follow before a forward."""
        state = dict(state)

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            return state.pop(name)

        def put(dst: torch.Tensor, src: torch.Tensor | QuantWeight, name: str) -> QuantWeight | None:
            """Copy src into dst; a QuantWeight is returned instead, for the caller to keep."""
            shape = (src.n, src.k) if isinstance(src, QuantWeight) else tuple(src.shape)
            if tuple(dst.shape) != shape:
                raise ValueError(f"{name}: checkpoint shape {shape}, model expects {tuple(dst.shape)}")
            if isinstance(src, QuantWeight):
                return src
            dst.copy_(src)
            return None

        def fused(names: list[str], whole: str) -> torch.Tensor | QuantWeight:
            if whole in state:  # Phi-3 ships q/k/v and gate/up fused already, in the same order
                return take(whole)
            parts = [take(n) for n in names]
            if any(isinstance(p, QuantWeight) for p in parts):
                if not all(isinstance(p, QuantWeight) for p in parts):
                    raise ValueError(f"{names}: some parts are quantized blocks and some are not")
                return concat(parts)
            return torch.cat(parts)

        shift = 1.0 if self.arch.norm_plus_one else 0.0

        def norm(dst: torch.Tensor, name: str) -> None:
            """A norm weight; Gemma's stored as w - 1, kept as 1 + w (in float32, as HF computes it)."""
            src = take(name)
            put(dst, src.float() + shift if shift else src, name)

        self.embed_blocks = put(self.embed, take("model.embed_tokens.weight"), "embed_tokens")
        norm(self.norm, "model.norm.weight")
        self.head_blocks = self.embed_blocks
        if not self.arch.tie_word_embeddings:
            self.head_blocks = put(self.lm_head, take("lm_head.weight"), "lm_head")
        state.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."

            def projection(name: str, src: torch.Tensor | QuantWeight, label: str, layer=layer) -> None:
                if (blocks := put(getattr(layer, name), src, label)) is not None:
                    layer.blocks[name] = blocks

            layer.blocks = {}
            projection("qkv", fused([a + f"{n}_proj.weight" for n in "qkv"], a + "qkv_proj.weight"), a + "qkv")
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]), a + "qkv bias")
            projection("o_proj", take(a + "o_proj.weight"), a + "o_proj")
            if layer.q_norm is not None:
                norm(layer.q_norm, a + "q_norm.weight")
                norm(layer.k_norm, a + "k_norm.weight")
            norm(layer.input_norm, p + "input_layernorm.weight")
            if layer.attn_out_norm is None:
                norm(layer.post_norm, p + "post_attention_layernorm.weight")
            else:  # Gemma: post_attention_layernorm norms the attention's output; the MLP has its own pair
                norm(layer.attn_out_norm, p + "post_attention_layernorm.weight")
                norm(layer.post_norm, p + "pre_feedforward_layernorm.weight")
                norm(layer.mlp_out_norm, p + "post_feedforward_layernorm.weight")
            gate_up = fused([m + "gate_proj.weight", m + "up_proj.weight"], m + "gate_up_proj.weight")
            projection("gate_up", gate_up, m + "gate_up")
            projection("down", take(m + "down_proj.weight"), m + "down_proj")
        leftovers = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"checkpoint has tensors this architecture does not use: {leftovers[:5]}")
