"""kvharbor's float32 CPU kernels (engine/cpu/csrc/cpu_kernels.c, AVX2 + FMA): the linears of
decode-sized inputs (float32 and quantized weights, engine/quantize.py), dequantization, paged
attention read in place from the KV cache (decode rows, and prompt rows in tiles), the layers'
pointwise ops; and the batch-invariant GEMMs over packed weights (csrc/packed_gemm.c: pack,
linear_packed; csrc/packed_int.c, quantized weights on AVX512-VNNI: pack_quant, linear_qpacked).

The C file is compiled once, with the system's C compiler, into a cache directory
($KVHARBOR_CACHE_DIR, else ~/.cache/kvharbor) under a name that hashes the source and the flags,
and loaded with ctypes (no torch headers: it builds in about a second). Where the CPU lacks AVX2
or FMA, no compiler is found, or the build fails, `load()` returns None once, logs why, and the
engine keeps torch's matmul: the fallback is the same code path as a build-less machine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kvharbor.common.machine import cpu_info
from kvharbor.engine.quantize import FORMATS, GROUP, QuantWeight

log = logging.getLogger("kvharbor.engine.cpu.cpu_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
# Compiled together into one library; the headers they include count in the build's hash too.
SOURCES = (CSRC / "cpu_kernels.c", CSRC / "packed_gemm.c", CSRC / "packed_int.c")
HEADERS = (CSRC / "packed_gemm.h", CSRC / "packed_int.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-lpthread", "-lm")
# Added where the CPU has VNNI: the integer dots of quantized decode products in one instruction
# per 32 codes (cpu_kernels.c dot_u8s8), the same sums. AVX-VNNI (VEX) where the CPU reports
# avx_vnni, else AVX512-VNNI's EVEX form on the same 256-bit registers (AMD Zen 4, Intel Ice Lake
# and Cascade Lake have only this one). Measured on a 2-core Xeon with AVX-VNNI, SmolLM2's four
# projection shapes x 30 layers at 8 rows: int8 weights 15.2 -> 11.4 ms, int4 14.8 -> 13.6 ms
# (noisy runs: 6-25%); the AVX512-VNNI figures are in engine/README.md.
VNNI_FLAGS = ("-mavxvnni",)
# prefer-vector-width keeps the rest of the file in 256-bit code, as the AVX2 build measured it
# (gcc still chose 512-bit registers at 8 places in it, against 73 without).
AVX512_VNNI_FLAGS = ("-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256")
# kvharbor_int_dot()'s answer: which integer dot a build compiled.
INT_DOTS = ("maddubs", "avx_vnni", "avx512_vnni")
# Rows up to which the kernel beats torch's float32 matmul here (2 cores, SmolLM2's shapes, weights
# streamed from memory): decode steps. Prefill chunks keep MKL, which blocks for large M.
MAX_ROWS = 16
# The LM head (vocab x hidden) stays ahead to larger M: MKL read it at 4-14 GFLOP/s at 1-8 rows.
MAX_ROWS_WIDE = 64
WIDE = 16384  # output columns from which a weight counts as wide
# Rows up to which a quantized product makes x int8 per group of 32 and sums integer dot products
# (cpu_kernels.c's INT_ROWS, quantize.INT_ROWS): there the float path is bound by widening the
# weights, not memory.
BF16_FORMAT = 4  # cpu_kernels.c's weight format 4: bfloat16 [n, k]
KV_FORMATS = {torch.float32: 0, torch.uint8: 1, torch.bfloat16: 2}  # the attention kernel's kv_fmt


def cache_dir() -> Path:
    return Path(os.environ.get("KVHARBOR_CACHE_DIR") or Path.home() / ".cache" / "kvharbor")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(cc: str, out_dir: Path, flags: tuple[str, ...] | None = None) -> Path:
    """Compile the kernel into out_dir (atomically) unless it is there already; returns the .so.
    `flags`: the compiler's (FLAGS unless given)."""
    flags = FLAGS if flags is None else flags
    text = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(text + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    target = out_dir / f"cpu_kernels-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *map(str, SOURCES), "-o", str(partial), *flags], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    return target


class CpuKernels:
    """The loaded kernels; every call is thread-safe (one runs at a time, on the pool's threads)."""

    def __init__(self, path: Path, threads: int) -> None:
        self.path = path  # the build: its name hashes the source and the flags (build)
        lib = ctypes.CDLL(str(path))
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.kvharbor_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.kvharbor_linear.restype = None
        c_int = ctypes.c_int
        lib.kvharbor_linear_quant.argtypes = [c_int, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.kvharbor_linear_quant.restype = c_int
        lib.kvharbor_dequantize.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64]
        lib.kvharbor_dequantize.restype = c_int
        lib.kvharbor_dequantize_packed.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.kvharbor_dequantize_packed.restype = c_int
        lib.kvharbor_decode_attention.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64,
                                                  i64, i64, ctypes.c_float, ctypes.c_int, i64,
                                                  ctypes.c_float, ptr, i64]  # fmt: skip
        lib.kvharbor_decode_attention.restype = ctypes.c_int
        lib.kvharbor_kv_write_int8.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64]
        lib.kvharbor_kv_write_int8.restype = None
        lib.kvharbor_kv_write.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64]
        lib.kvharbor_kv_write.restype = None
        lib.kvharbor_kv_write_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64]
        lib.kvharbor_kv_write_bf16.restype = None
        lib.kvharbor_add_rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        lib.kvharbor_add_rms_norm.restype = None
        lib.kvharbor_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
        lib.kvharbor_rope.restype = None
        lib.kvharbor_silu_mul.argtypes = [ptr, i64, ptr, i64, i64]
        lib.kvharbor_silu_mul.restype = None
        lib.kvharbor_gelu_tanh_mul.argtypes = [ptr, i64, ptr, i64, i64]
        lib.kvharbor_gelu_tanh_mul.restype = None
        lib.kvharbor_lora_decode.argtypes = [c_int, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, c_int,
                                             ptr, i64]  # fmt: skip
        lib.kvharbor_lora_decode.restype = c_int
        lib.kvharbor_set_spin.argtypes = [ctypes.c_int]
        lib.kvharbor_set_spin.restype = None
        if (spin := os.environ.get("KVHARBOR_KERNEL_SPIN")) is not None:
            lib.kvharbor_set_spin(int(spin))
        lib.kvharbor_set_threads.argtypes = [ctypes.c_int]
        lib.kvharbor_set_threads.restype = ctypes.c_int
        lib.kvharbor_int_dot.argtypes = []
        lib.kvharbor_int_dot.restype = c_int
        lib.kvharbor_linear_isa.argtypes = [c_int]
        lib.kvharbor_linear_isa.restype = c_int
        lib.kvharbor_packed_width.argtypes = []
        lib.kvharbor_packed_width.restype = c_int
        lib.kvharbor_bf16_dot.argtypes = []
        lib.kvharbor_bf16_dot.restype = c_int
        lib.kvharbor_linear_packed.argtypes = [c_int, c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.kvharbor_linear_packed.restype = c_int
        lib.kvharbor_qpacked_vnni.argtypes = []
        lib.kvharbor_qpacked_vnni.restype = c_int
        lib.kvharbor_qpacked_panel_bytes.argtypes = [c_int, i64]
        lib.kvharbor_qpacked_panel_bytes.restype = i64
        lib.kvharbor_linear_qpacked.argtypes = [c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        lib.kvharbor_linear_qpacked.restype = c_int
        self._lib = lib
        self.int_dot = INT_DOTS[lib.kvharbor_int_dot()]
        self.threads = lib.kvharbor_set_threads(threads)
        if os.environ.get("KVHARBOR_KERNEL_LANES") == "8":
            lib.kvharbor_linear_isa(0)
        self._scratch = torch.empty(0, dtype=torch.float32)

    def lanes(self, want: int | None = None) -> int:
        """The float32 / bfloat16 linears' vector width: 16 where the CPU has AVX-512F, else 8
        (KVHARBOR_KERNEL_LANES=8 keeps 8). `want` 8 or 16 chooses (16 only where the CPU has it);
        every row count takes the same width, so a process keeps one for its rows' bits."""
        if want not in (None, 8, 16):
            raise ValueError(f"lanes are 8 or 16, not {want}")
        return 16 if self._lib.kvharbor_linear_isa(-1 if want is None else want // 16) else 8

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ weight [n, k]^T (+ bias), float32, CPU; x rows may be strided, weight contiguous."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        if x.dtype != torch.float32 or weight.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"linear takes float32 x [m, k] and a contiguous [n, {k}] weight, got {x.dtype} "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")  # fmt: skip
        if weight.dtype != torch.float32:
            raise ValueError(f"linear takes a float32 weight, not {weight.dtype}")
        y = torch.empty(m, n, dtype=torch.float32)
        self._lib.kvharbor_linear(
            x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
            y.data_ptr(), n, m, k, n,
        )  # fmt: skip
        return y

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 @ weight [n, k]^T (+ bias float32) for a contiguous bfloat16 weight, as float32:
        each weight widened exactly, every product summed in float32, in the same order for any m
        (the kernel's tile), so a row's result does not depend on the other rows."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        kinds = (x.dtype, weight.dtype) == (torch.float32, torch.bfloat16)
        if not kinds or weight.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"linear_bf16 takes float32 x [m, k] and a contiguous bfloat16 [n, {k}] weight, got "
                             f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")  # fmt: skip
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        y = torch.empty(m, n, dtype=torch.float32)
        if m == 0:
            return y
        code = self._lib.kvharbor_linear_quant(
            BF16_FORMAT, x.data_ptr(), x.stride(0), weight.data_ptr(), None, None, _ptr(bias), y.data_ptr(), n, m, k, n
        )
        if code != 0:
            raise ValueError(f"the kernel does not take a bfloat16 weight of {n}x{k}")
        return y

    def packed_width(self) -> int:
        """The panel width pack uses on this process's ISA (lanes()): 32 columns on 16 lanes, else 16."""
        return self._lib.kvharbor_packed_width()

    def bf16_dot(self) -> bool:
        """Whether pack(..., dot=True) runs here: AVX512-BF16 with the linears on 16 lanes."""
        return bool(self._lib.kvharbor_bf16_dot())

    def pack(self, weight: torch.Tensor, dot: bool = False) -> PackedWeight:
        """A float32 or bfloat16 [n, k] weight in the layout linear_packed reads (packed_gemm.c):
        panels of this ISA's width, [ceil(n / width)][k][width], the last padded with zeros; a
        bfloat16 panel's two halves interleaved (element 2i column i, 2i + 1 column i + width / 2).
        `dot` (a bfloat16 weight, where bf16_dot()): panels of k-pairs, [ceil(n / 32)][ceil(k / 2)]
        [32 x 2], which linear_packed multiplies by x rounded to bfloat16 (vdpbf16ps)."""
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" \
                or weight.shape[1] < 1:  # fmt: skip
            raise ValueError(f"pack takes a float32 or bfloat16 [n, k] CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")  # fmt: skip
        if dot and (weight.dtype != torch.bfloat16 or not self.bf16_dot()):
            raise ValueError(f"pack(dot=True) takes a bfloat16 weight on a CPU with AVX512-BF16 (got {weight.dtype}"
                             f"{'' if self.bf16_dot() else '; this CPU has none'}): pack it without dot")  # fmt: skip
        nr = self.packed_width()
        n, k = weight.shape
        panels = -(-n // nr)
        if n % nr:
            weight = torch.cat([weight, weight.new_zeros(panels * nr - n, k)])
        if dot:
            pairs = -(-k // 2)
            if k % 2:
                weight = torch.cat([weight, weight.new_zeros(weight.shape[0], 1)], dim=1)
            grouped = weight.view(panels, nr, pairs, 2).transpose(1, 2)
            return PackedWeight(grouped.reshape(panels, pairs, 2 * nr).contiguous(), n, k, nr, dot=True)
        grouped = weight.view(panels, nr, k)
        if weight.dtype == torch.bfloat16:
            grouped = grouped.view(panels, 2, nr // 2, k).transpose(1, 2).reshape(panels, nr, k)
        return PackedWeight(grouped.transpose(1, 2).contiguous(), n, k, nr)

    def linear_packed(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 @ W^T (+ bias float32) over a packed weight (pack), as float32: each output
        one float32 sum over k in order, whatever m, so a row's result does not depend on the others.
        A `dot` weight takes x rounded to bfloat16 (each element by itself), products in k-pairs."""
        x, bias, y = _packed_call("linear_packed", x, weight.k, weight.n, bias)
        m, k = x.shape
        if m == 0:
            return y
        fmt = 2 if weight.dot else int(weight.data.dtype == torch.bfloat16)
        code = self._lib.kvharbor_linear_packed(
            fmt, weight.width, x.data_ptr(), x.stride(0), weight.data.data_ptr(), _ptr(bias), y.data_ptr(),
            weight.n, m, k, weight.n,
        )  # fmt: skip
        if code == -2:
            raise MemoryError(f"linear_packed could not allocate x in bfloat16 for {m} rows")
        if code != 0:
            kind = "bfloat16 k-pair panels" if weight.dot else f"panels {weight.width} wide"
            raise ValueError(f"this CPU has no microkernel for {kind} (packed on another CPU?)")
        return y

    def int_packs(self) -> bool:
        """Whether pack_quant and linear_qpacked run here: AVX512-VNNI, with the linears on 16 lanes."""
        return bool(self._lib.kvharbor_qpacked_vnni())

    def pack_quant(self, w: QuantWeight) -> QuantPacked:
        """A quantized weight in the layout linear_qpacked reads (csrc/packed_int.c): panels of 32
        columns, group by group, [ceil(n / 32)][k / 32][codes, 32 scales (, 32 mins)] (int8: its
        32 scales after the groups), the last panel padded with zero columns; int8 codes stored
        plus 128."""
        if not self.int_packs():
            raise ValueError("pack_quant needs AVX512-VNNI with the linears on 16 lanes: run the weight "
                             "through linear_quant instead")  # fmt: skip
        if w.fmt not in FORMATS or w.k % GROUP:
            raise ValueError(f"pack_quant takes a {'/'.join(FORMATS)} weight with k a multiple of {GROUP}, "
                             f"got {w.fmt} with k = {w.k}")  # fmt: skip
        return QuantPacked(_pack_quant(w), w.fmt, w.n, w.k)

    def linear_qpacked(self, x: torch.Tensor, w: QuantPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 @ W^T (+ bias) over a packed quantized weight (pack_quant), as float32:
        x made 16-bit codes per row and group of 32 (two bytes), each group two exact integer dot
        products, and each output's groups summed in order, whatever m: a row's result does not
        depend on the others. A NaN or inf in a row of x gives that row non-finite outputs, as float
        products would."""
        x, bias, y = _packed_call("linear_qpacked", x, w.k, w.n, bias)
        m, k = x.shape
        if m == 0:
            return y
        code = self._lib.kvharbor_linear_qpacked(
            QUANT_FORMATS[w.fmt], x.data_ptr(), x.stride(0), w.data.data_ptr(), _ptr(bias), y.data_ptr(), w.n, m, k, w.n
        )
        if code == -2:
            raise MemoryError(f"no memory for the 16-bit codes of {m} rows")
        if code != 0:
            raise ValueError("this CPU has no integer microkernel for packed quantized weights (packed on "
                             "another CPU?): run the weight through linear_quant")
        return y

    def lora_plan(self, a: torch.Tensor, bt: list[torch.Tensor], offsets: list[int]) -> LoRAPlan:
        """What lora_decode needs of one projection's slots: a [subs, slots, rank, k] and bt[j]
        [out_j, slots * rank], contiguous, all float32 or all bfloat16 (checked once, here)."""
        subs, slots, rank, _ = a.shape
        if a.dtype not in (torch.float32, torch.bfloat16) or not a.is_contiguous() or len(bt) != subs:
            raise ValueError(f"lora_plan takes a contiguous float32 or bfloat16 A and {subs} B^T, got {a.dtype}")
        for b in bt:
            if b.dtype != a.dtype or not b.is_contiguous() or b.shape[1] != slots * rank:
                raise ValueError(f"lora_plan takes contiguous B^T [out, {slots * rank}] of {a.dtype}")
        ptrs = (ctypes.c_void_p * subs)(*(b.data_ptr() for b in bt))
        outs = (ctypes.c_int64 * subs)(*(b.shape[0] for b in bt))
        width = max(o + b.shape[0] for o, b in zip(offsets, bt, strict=True))
        return LoRAPlan(a, tuple(bt), ptrs, outs, (ctypes.c_int64 * subs)(*offsets), width)

    def lora_decode(self, plan: LoRAPlan, x: torch.Tensor, row_slot: torch.Tensor, enabled: int, y: torch.Tensor):
        """y[r, offsets[j]:][: out_j] += x[r] A[j, slot]^T B_j[slot]^T for each row r and each sub-projection
        j with bit j of `enabled` set, slot = row_slot[r] (int32; -1: the row is left alone). x and y
        in the plan's dtype, rows strided, columns contiguous; y's rows wide enough for every offset."""
        a = plan.a
        subs, slots, rank, k = a.shape
        m = x.shape[0]
        if x.dtype != a.dtype or y.dtype != a.dtype or x.stride(1) != 1 or y.stride(1) != 1 or x.shape[1] != k:
            raise ValueError(f"lora_decode takes x [m, {k}] and y of {a.dtype} with contiguous columns")
        if row_slot.dtype != torch.int32 or row_slot.shape != (m,) or y.shape[0] != m:
            raise ValueError(f"lora_decode takes an int32 slot per row of x and y ({m})")
        if y.shape[1] < plan.width:
            raise ValueError(f"lora_decode writes columns up to {plan.width}: y has {y.shape[1]}")
        code = self._lib.kvharbor_lora_decode(
            int(a.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), row_slot.data_ptr(), m, k, a.data_ptr(), subs,
            slots, rank, plan.bt_ptrs, plan.outs, plan.offsets, enabled, y.data_ptr(), y.stride(0),
        )  # fmt: skip
        if code == -2:
            raise MemoryError(f"no memory for the shrink of {m} rows")
        if code == -3:
            raise ValueError(f"a row's slot is outside -1..{slots - 1}: {row_slot.tolist()}")
        if code != 0:
            raise ValueError(f"the kernel does not take {subs} sub-projections")

    def linear_quant(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] float32 @ w^T (+ bias) for a weight in a kernel format (engine/quantize.py)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.dtype != torch.float32 or x.shape[1] != w.k:
            raise ValueError(f"linear_quant takes float32 x [m, {w.k}], got {x.dtype} {tuple(x.shape)}")
        if bias is not None and bias.dtype != torch.float32:  # a bfloat16 model's (Qwen2's qkv bias)
            bias = bias.float()
        m = x.shape[0]
        y = torch.empty(m, w.n, dtype=torch.float32)
        if m == 0:
            return y
        code = self._lib.kvharbor_linear_quant(
            FORMATS[w.fmt], x.data_ptr(), x.stride(0), w.data.data_ptr(), w.scale.data_ptr(), _ptr(w.mins),
            _ptr(bias), y.data_ptr(), w.n, m, w.k, w.n,
        )  # fmt: skip
        if code == -2:
            raise MemoryError(f"no memory for the activation buffers (group sums, int8 codes) of {m} rows")
        if code != 0:
            raise ValueError(f"the kernel does not take a {w.fmt} weight of {w.n}x{w.k}")
        return y

    def dequantize(self, w: QuantWeight, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of w as float32 [last - first, k], in a scratch buffer this object
        reuses: valid until the next call."""
        rows = last - first
        out = self._scratch_for(rows * w.k).view(rows, w.k)
        self._dequantize(w, first, rows, out, 0)
        return out

    def dequantize_packed(self, w: QuantWeight, first: int, last: int) -> PackedWeight:
        """Rows [first, last) of w as a float32 packed weight (pack's layout, this ISA's width),
        dequantized straight into it, in the scratch buffer dequantize uses: valid until the next
        call. What a prefill product over quantized weights multiplies (linear_packed)."""
        rows, nr = last - first, self.packed_width()
        panels = -(-rows // nr)
        data = self._scratch_for(panels * w.k * nr).view(panels, w.k, nr)
        self._dequantize(w, first, rows, data, nr)  # the last panel's padding columns written as zeros
        return PackedWeight(data, rows, w.k, nr)

    def _scratch_for(self, floats: int) -> torch.Tensor:
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch[:floats]

    def _dequantize(self, w: QuantWeight, first: int, rows: int, out: torch.Tensor, nr: int) -> None:
        per_row = w.scale.numel() // w.n
        code = self._lib.kvharbor_dequantize_packed(
            FORMATS[w.fmt], w.data[first:].data_ptr(), w.scale.data_ptr() + first * per_row * 4,
            w.mins.data_ptr() + first * per_row * 4 if w.mins is not None else None, out.data_ptr(), w.k, w.k, rows,
            nr,
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the kernel does not take a {w.fmt} weight of {w.n}x{w.k}")

    def kv_write_int8(
        self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, bounds: tuple[int, int] | None = None
    ) -> None:
        """Quantize rows [T, heads, dim] float32 (engine/kv/kv_quant.py's int8 rows, the same bytes
        as quantize_rows) and write each token's at its slot of cache [heads, slots, dim + 2] uint8.
        `bounds`: the slots' (min, max) where the caller knows them (else they are computed)."""
        self._kv_write(self._lib.kvharbor_kv_write_int8, rows, slots, cache, bounds, torch.uint8, 2)

    def kv_write(
        self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, bounds: tuple[int, int] | None = None
    ) -> None:
        """Copy rows [T, heads, dim] float32 to their slots of cache [heads, slots, dim] float32, or
        of a bfloat16 cache rounded to nearest even (as .to(torch.bfloat16)); `bounds` as for
        kv_write_int8."""
        if cache.dtype == torch.bfloat16:
            self._kv_write(self._lib.kvharbor_kv_write_bf16, rows, slots, cache, bounds, torch.bfloat16, 0)
        else:
            self._kv_write(self._lib.kvharbor_kv_write, rows, slots, cache, bounds, torch.float32, 0)

    @staticmethod
    def _kv_write(fn, rows, slots, cache, bounds, cache_dtype: torch.dtype, extra: int) -> None:
        t, heads, dim = rows.shape
        unit = rows.stride(2) == 1 and slots.is_contiguous()
        if rows.dtype != torch.float32 or slots.dtype != torch.int64 or not unit:
            raise ValueError("a KV write takes float32 rows with unit-stride heads and contiguous int64 slots")
        if cache.dtype != cache_dtype or not cache.is_contiguous() or cache.shape[::2] != (heads, dim + extra):
            kind = str(cache_dtype).removeprefix("torch.")
            raise ValueError(f"a KV write needs a contiguous {kind} cache [{heads}, slots, {dim + extra}]")
        if t and bounds is None:
            bounds = int(slots.min()), int(slots.max())
        if slots.numel() != t or (t and not 0 <= bounds[0] <= bounds[1] < cache.shape[1]):
            raise ValueError(f"a KV write needs one slot per row, each in [0, {cache.shape[1]})")
        fn(rows.data_ptr(), rows.stride(0), rows.stride(1), slots.data_ptr(), t, heads, dim, cache.data_ptr(),
           cache.shape[1])  # fmt: skip

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place; x None: no add), then the RMS norm of residual times weight,
        as a new tensor. float32; residual and weight contiguous, x rows may be strided."""
        rows, hidden = residual.shape
        if not residual.is_contiguous() or weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"add_rms_norm needs a contiguous residual [rows, {hidden}] and weight [{hidden}]")
        if x is not None and (x.shape != residual.shape or x.stride(1) != 1):
            raise ValueError(f"add_rms_norm adds x {tuple(x.shape)} to a residual {tuple(residual.shape)}")
        if any(t is not None and t.dtype != torch.float32 for t in (x, residual, weight)):
            raise ValueError("add_rms_norm takes float32 tensors")
        out = torch.empty_like(residual)
        self._lib.kvharbor_add_rms_norm(
            _ptr(x), 0 if x is None else x.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows,
            hidden, eps,
        )  # fmt: skip
        return out

    def rope(self, x: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE (rotate-half) in place on the first `heads` heads of each row of x [rows, >= heads *
        dim] float32; cos, sin [rows, dim / 2] float32 contiguous."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] < heads * dim or dim % 2:
            raise ValueError(f"rope takes float32 rows of at least {heads} heads of an even dim {dim}")
        for t in (cos, sin):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != rows * (dim // 2):
                raise ValueError(f"rope needs contiguous float32 cos and sin of [{rows}, {dim // 2}]")
        self._lib.kvharbor_rope(x.data_ptr(), x.stride(0), rows, heads, dim, cos.data_ptr(), sin.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows of gate_up [rows, 2 * inter] float32 (gate first), as [rows, inter]."""
        return self._gated(gate_up, self._lib.kvharbor_silu_mul, "silu_mul")

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up, laid out as for silu_mul (Gemma's MLP)."""
        return self._gated(gate_up, self._lib.kvharbor_gelu_tanh_mul, "gelu_tanh_mul")

    @staticmethod
    def _gated(gate_up: torch.Tensor, fn, name: str) -> torch.Tensor:
        rows, width = gate_up.shape
        if gate_up.dtype != torch.float32 or gate_up.stride(1) != 1 or width % 2:
            raise ValueError(f"{name} takes float32 rows of gate and up, got {gate_up.dtype} {tuple(gate_up.shape)}")
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2)
        return out

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, heads, dim] (rows may be strided)
        k_cache: torch.Tensor,  # [kv_heads, slots, dim] float32 or bfloat16, or uint8 [.., dim + 2] (int8 KV)
        v_cache: torch.Tensor,
        tables: torch.Tensor,  # [B, max_blocks] int32
        ctx_lens: torch.Tensor,  # [B] int32
        block_size: int,
        out: torch.Tensor,  # [B, heads, dim] (rows may be strided), written
        scale: float | None = None,  # the scores' scale; None: dim ** -0.5
        window: int = 0,  # > 0: attend to the last `window` positions of each context only
        softcap: float = 0.0,  # > 0: scores soft-capped, softcap * tanh(score / softcap)
        runs: torch.Tensor | None = None,  # int64 [n + 1] row offsets: runs of one sequence's rows
    ) -> None:
        """Attention of one query per row over its first ctx_lens positions, in place from the
        paged cache (float32 or bfloat16 rows, or engine/kv/kv_quant.py's int8 rows); q and out
        float32. `runs`: rows [runs[i], runs[i + 1]) are one sequence's consecutive positions (the
        same table), attended in tiles that read each K/V block once; None: every row its own.
        A query's result does not depend on the others in the call, nor on the runs. Raises
        ValueError for a shape the kernel does not take."""
        b, heads, dim = q.shape
        kv_heads, slots, row = k_cache.shape
        kv_fmt = KV_FORMATS.get(k_cache.dtype)
        if kv_fmt is None or row != (dim + 2 if kv_fmt == 1 else dim) or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"decode attention reads float32 or bfloat16 rows of {dim} or int8 rows of {dim + 2}, "
                             f"got {k_cache.dtype} rows of {row}")  # fmt: skip
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != dim or t.dtype != torch.float32:
                raise ValueError(f"decode attention needs {name} float32 with its heads packed in each row")
        # Attributes only here (this runs every layer); the kernel checks the offsets themselves.
        if runs is not None and (runs.dtype != torch.int64 or not runs.is_contiguous() or runs.dim() != 1
                                 or runs.numel() < 2):  # fmt: skip
            raise ValueError(f"decode attention's runs are contiguous int64 row offsets rising from 0 to {b}")
        code = self._lib.kvharbor_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots * row * k_cache.element_size(),
            tables.data_ptr(), tables.stride(0), ctx_lens.data_ptr(), out.data_ptr(), out.stride(0), b, heads,
            kv_heads, dim, block_size, dim**-0.5 if scale is None else scale, kv_fmt, window, softcap,
            _ptr(runs), 0 if runs is None else runs.numel() - 1,
        )  # fmt: skip
        if code == -2:
            raise MemoryError("decode attention could not allocate its tiles")
        if code == -3:
            raise ValueError(f"decode attention's runs are contiguous int64 row offsets rising from 0 to {b}")
        if code != 0:
            raise ValueError(f"decode attention does not take heads={heads}, kv_heads={kv_heads}, dim={dim}")

    @staticmethod
    def takes_attention(heads: int, kv_heads: int, dim: int) -> bool:
        """Whether decode_attention takes this shape (GQA groups up to 16, dim a multiple of 8 up to 256)."""
        return heads % kv_heads == 0 and heads // kv_heads <= 16 and dim % 8 == 0 and dim <= 256


@dataclass(frozen=True)
class PackedWeight:
    """A weight as CpuKernels.pack lays it out: `data` [panels, k, width], or with `dot` [panels,
    ceil(k / 2), 2 * width] (k-pairs), `n` real columns."""

    data: torch.Tensor
    n: int
    k: int
    width: int
    dot: bool = False

    def __post_init__(self) -> None:
        # Checked once here, not on every linear_packed call (a step makes ~120): the kernel reads
        # data through its raw pointer, as this layout.
        panels = -(-self.n // max(1, self.width))
        laid_out = (panels, -(-self.k // 2), 2 * self.width) if self.dot else (panels, self.k, self.width)
        dtypes = (torch.bfloat16,) if self.dot else (torch.float32, torch.bfloat16)
        data = self.data
        if data.dtype not in dtypes or not data.is_contiguous() or data.device.type != "cpu" \
                or tuple(data.shape) != laid_out or self.k < 1:  # fmt: skip
            raise ValueError(f"a packed weight is laid out as pack() lays it out, {laid_out}, got {data.dtype} "
                             f"{tuple(data.shape)}")  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as it was before packing, [len(ids), k]: a tied embedding's
        lookups read the LM head's packed copy, so no unpacked one is kept."""
        panel, col = ids // self.width, ids % self.width
        if self.dot:  # [panels, pairs, width, 2]
            pairs = self.data.view(self.data.shape[0], -1, self.width, 2)[panel, :, col]
            return pairs.reshape(len(ids), -1)[:, : self.k]
        if self.data.dtype == torch.bfloat16:  # the half-panels interleaved (pack)
            half = self.width // 2
            col = torch.where(col < half, 2 * col, 2 * (col - half) + 1)
        return self.data[panel, :, col]

    def unpack(self) -> torch.Tensor:
        """The whole weight as it was before packing, [n, k]."""
        return self.rows(torch.arange(self.n))


QUANT_PANEL = 32  # columns per panel of a packed quantized weight (csrc/packed_int.c)
QUANT_FORMATS = {"q8": 0, "q4": 1, "int8": 2}  # csrc/packed_int.h's QPACKED_*


def quant_group_bytes(fmt: str) -> int:
    """The bytes of one panel's group of 32 k (csrc/packed_int.c group_bytes): its codes, then q8's
    32 scales, or q4's 32 scales and 32 mins; int8 keeps its 32 scales after the last group."""
    return {"q4": 512 + 2 * QUANT_PANEL * 4, "q8": 1024 + QUANT_PANEL * 4, "int8": 1024}[fmt]


def quant_panel_bytes(fmt: str, k: int) -> int:
    """The bytes of one 32-column panel (csrc/packed_int.c qpacked_panel_bytes)."""
    return k // GROUP * quant_group_bytes(fmt) + (QUANT_PANEL * 4 if fmt == "int8" else 0)


@dataclass(frozen=True)
class QuantPacked:
    """A quantized weight as CpuKernels.pack_quant lays it out: `data` uint8 [panels, panel bytes]
    (csrc/packed_int.c), `fmt` the weight's (q4: 4-bit codes with mins; q8 and int8: int8 codes),
    `n` real columns."""

    data: torch.Tensor
    fmt: str
    n: int
    k: int

    def __post_init__(self) -> None:
        # Checked once here: the kernel reads data through its raw pointer, as this layout.
        known = self.fmt in QUANT_FORMATS and self.k >= GROUP and self.k % GROUP == 0
        laid_out = (-(-self.n // QUANT_PANEL), quant_panel_bytes(self.fmt, self.k) if known else -1)
        if not known or self.data.dtype != torch.uint8 or not self.data.is_contiguous() \
                or tuple(self.data.shape) != laid_out or self.data.device.type != "cpu":  # fmt: skip
            raise ValueError(f"a packed quantized weight is laid out as pack_quant lays it out, {laid_out} uint8, "
                             f"got {self.fmt} {self.data.dtype} {tuple(self.data.shape)}")  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, float32 [len(ids), k], the same bits as the weight's own
        dequantize: a tied embedding's lookups read the LM head's packed copy, so no other is kept."""
        panels, groups, count = self.data.shape[0], self.k // GROUP, len(ids)
        if count and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"rows must be in [0, {self.n}), got {int(ids.min())}..{int(ids.max())}")
        panel, col = ids // QUANT_PANEL, ids % QUANT_PANEL
        half, column = col // (QUANT_PANEL // 2), col % (QUANT_PANEL // 2)
        size, q4 = (512 if self.fmt == "q4" else 1024), self.fmt == "q4"  # a group's codes' bytes
        grouped = self.data[:, : groups * quant_group_bytes(self.fmt)].view(panels, groups, -1)
        codes = grouped[..., :size].view(panels, groups, -1, 2, QUANT_PANEL // 2, 4)[panel, :, :, half, column]
        if self.fmt == "int8":  # [ids, groups, 8 quads, 4], stored plus 128; the scales after the groups
            scale = self.data[:, groups * 1024 :].view(torch.float32)[panel, col].contiguous()
            data = (codes.to(torch.int16) - 128).to(torch.int8).reshape(count, self.k)
            return QuantWeight("int8", data, scale, None, self.k).dequantize()
        floats = grouped[..., size:].view(torch.float32)  # [panels, groups, 32 scales (+ 32 mins)]
        scale = floats[panel, :, col].contiguous()
        if not q4:
            data = (codes.to(torch.int16) - 128).to(torch.int8).reshape(count, self.k)
            return QuantWeight("q8", data, scale, None, self.k).dequantize()
        quads = torch.stack([codes & 15, codes >> 4], dim=3).reshape(count, groups, GROUP)  # element order
        nibbles = quads[..., : GROUP // 2] | (quads[..., GROUP // 2 :] << 4)  # GGUF's: j low, j + 16 high
        mins = floats[panel, :, QUANT_PANEL + col].contiguous()
        return QuantWeight("q4", nibbles.reshape(count, -1), scale, mins, self.k).dequantize()


def _pack_quant(w: QuantWeight) -> torch.Tensor:
    """The bytes of pack_quant's layout (csrc/packed_int.c says what each holds)."""
    n, groups, nr = w.n, w.k // GROUP, QUANT_PANEL
    panels = -(-n // nr)
    pad = panels * nr - n
    if w.fmt == "q4":  # GGUF's in-group order: byte j holds element j (low) and j + 16 (high)
        half = w.data.view(n, groups, GROUP // 2)
        codes = torch.cat([half & 15, half >> 4], dim=-1)  # [n, groups, 32] in element order
    else:
        codes = (w.data.view(n, groups, GROUP).to(torch.int16) + 128).to(torch.uint8)
    codes = F.pad(codes, (0, 0, 0, 0, 0, pad))
    # [panels, 2 halves, 16 columns, groups, quads, 4 k] -> [panels, groups, quads, halves, columns, 4 k]
    quads = codes.view(panels, 2, nr // 2, groups, GROUP // 4, 4).permute(0, 3, 4, 1, 2, 5)
    if w.fmt == "q4":  # a pair of quads in one byte each: the first low, the second high
        quads = quads[:, :, 0::2] | (quads[:, :, 1::2] << 4)
    laid = [quads.reshape(panels, groups, -1)]
    if w.fmt == "int8":  # one scale per column, after the groups: [panels, 32] as bytes
        scales = F.pad(w.scale, (0, pad)).view(panels, nr).contiguous().view(torch.uint8)
        return torch.cat([laid[0].reshape(panels, -1), scales], dim=-1).contiguous()
    for f in [w.scale] + ([w.mins] if w.mins is not None else []):  # [n, groups] -> [panels, groups, 32]
        f = F.pad(f.view(n, groups), (0, 0, 0, pad))
        laid.append(f.reshape(panels, nr, groups).transpose(1, 2).contiguous().view(torch.uint8))
    return torch.cat(laid, dim=-1).reshape(panels, -1).contiguous()


@dataclass(frozen=True)
class LoRAPlan:
    """One projection's slot weights for CpuKernels.lora_decode, with the C arrays of its B^T
    pointers, widths and column offsets (the tensors are held so the pointers stay valid)."""

    a: torch.Tensor
    bt: tuple[torch.Tensor, ...]
    bt_ptrs: ctypes.Array
    outs: ctypes.Array
    offsets: ctypes.Array
    width: int  # the output columns the plan writes up to


def _packed_call(name: str, x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None):
    """A packed GEMM's inputs as its kernel reads them, checked: x float32 [m, k] on the CPU with
    contiguous elements (rows may be strided), bias float32 [n] or None; and its output y [m, n]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"{name} takes float32 x [m, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None:
        bias = bias.float().contiguous()
        if bias.shape != (n,) or bias.device.type != "cpu":
            raise ValueError(f"{name} takes a bias of [{n}], got {tuple(bias.shape)}")
    return x, bias, torch.empty(x.shape[0], n, dtype=torch.float32)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@cache
def load(threads: int) -> CpuKernels | None:
    """The kernel for this machine, built on first use; None (logged once, with the reason) where
    it cannot run here."""
    cpu = cpu_info()
    if cpu.arch not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu.flags:
        log.info("no AVX2+FMA on this CPU: float32 linears use torch's matmul")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang or $CC) found: float32 decode linears use torch's matmul")
        return None
    try:
        path = _build_for(cc, cpu)
    except (OSError, RuntimeError) as exc:
        log.warning("could not build the AVX2 kernels, float32 steps use torch's matmul and attention: %s", exc)
        return None
    return CpuKernels(path, threads)


def vnni_flags(cpu) -> tuple[str, ...]:
    """The compiler flags that give this CPU's VNNI dot (none where it has none)."""
    if "avx_vnni" in cpu.flags:
        return VNNI_FLAGS
    if {"avx512_vnni", "avx512vl"} <= cpu.flags:
        return AVX512_VNNI_FLAGS
    return ()


def _build_for(cc: str, cpu) -> Path:
    """The build for this CPU: with its vnni_flags where it has some and the compiler knows them."""
    if extra := vnni_flags(cpu):
        try:
            return build(cc, cache_dir(), (*FLAGS, *extra))
        except RuntimeError as exc:
            log.info("building without VNNI (the compiler refused %s): %s", " ".join(extra), str(exc)[:200])
    return build(cc, cache_dir())


class SkinnyLinear:
    """One float32 weight: decode-sized inputs through the kernel, larger ones through oneDNN's
    packed copy when there is one (measured here 1.0-1.5x MKL at 32-512 rows), else F.linear."""

    def __init__(
        self, gemm: CpuKernels, weight: torch.Tensor, packed: torch.Tensor | None = None, max_rows: int | None = -1
    ) -> None:
        """`max_rows`: the most rows that go through the kernel (-1: chosen by the weight's width;
        None: every row count, as batch-invariant mode runs)."""
        self.gemm = gemm
        self.weight = weight.contiguous()
        self.packed = packed
        if max_rows == -1:
            max_rows = MAX_ROWS_WIDE if weight.shape[0] >= WIDE else MAX_ROWS
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            return self.gemm.linear(x, self.weight, bias)
        if self.packed is not None:
            from kvharbor.engine.cpu.cpu_linear import packed_linear

            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)
