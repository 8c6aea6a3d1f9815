"""How close the engine's kernels come to this machine's limits (issue 50's roofline).

Two probes first (benchmarks/csrc/roofline_probe.c, compiled here): the cores' peak rates (AVX2 FMA,
AVX-512 FMA, AVX512-BF16 dots and AVX512-VNNI int8 dots where the CPU has them) and the memory read
bandwidth. Then, on every thread the engine uses:

- the linears at M = 1, 8, 128 and 2,048 rows on SmolLM2-135M's shapes: kvharbor's batch-invariant
  packed GEMM (float32 weights, and bfloat16 weights widened to float32; the LM head's shape on the
  dot-product kernel that serves it), the packed integer GEMM on q4 weights where the CPU has
  AVX512-VNNI (against half the VNNI dot's rate: x's two bytes take two products each), and torch's
  (MKL / oneDNN) float32 and bfloat16 matmuls;
- the paged attention kernel: a 2,048-row prompt in tiles (against the float32 peak) and 8
  decode rows over 2,000 positions each, K/V from memory (against the bandwidth);
- a whole decode step of SmolLM2-135M at 8 running requests, float32, batch-invariant.

Each figure is set against the limit that binds it: the roofline time is the larger of its
operations over the peak (float32 work against the best float32 FMA probe, torch's bfloat16
matmul against the bfloat16 dot probe where the CPU has one) and its bytes over the bandwidth
(the weight read once, the activations in and out); "of roofline" is that time over the measured
one. A decode step's bound is its weight bytes over the bandwidth. Prints a table, writes
benchmarks/results/roofline.json (with the machine) and a roofline plot beside it.

    python benchmarks/roofline.py [--rows 1 8 128 2048] [--rounds 5] [--no-decode]
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvharbor.common.machine import cpu_info, machine_record, machine_title
from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.quantize import quantize_int4

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROBE_SOURCE = HERE / "csrc" / "roofline_probe.c"
# SmolLM2-135M's linears, [out, in]: q/o, k/v, gate/up, down, and the LM head.
SHAPES = {"qo": (576, 576), "kv": (192, 576), "gate_up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PROBES = {"avx2_fma": 0, "avx512_fma": 1, "avx512_bf16_dot": 2, "avx512_vnni_dot": 4}
PROBE_FLAGS = {"avx2_fma": {"avx2", "fma"}, "avx512_fma": {"avx512f"}, "avx512_bf16_dot": {"avx512f", "avx512_bf16"},
               "avx512_vnni_dot": {"avx512f", "avx512_vnni"}}  # fmt: skip
FMA_ROUNDS = 2_000_000  # ~3 ms per probe here
READ_BYTES = 512 << 20  # far past any cache here
# The FMA peak is one core's best times the threads: a peak probed on all threads at once is
# lowered by a neighbour on any one core for the whole probe (beside a busy test worker, every one
# of 40 probes read half the peak, and then the kernels, timed after the neighbour finished, read
# 166% of it), while one thread finds a free core. The best of many short probes finds the quiet
# windows: 40 of 3 ms gave the same best as 8 of 30 ms here, in half the time. Bandwidth is shared
# by the cores, not per core, so it is probed on all threads.
FMA_PROBES = 40
READ_PROBES = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128, 2048], help="rows per linear (M)")
    parser.add_argument("--shapes", nargs="+", default=["gate_up", "down"], choices=sorted(SHAPES),
                        help="SmolLM2-135M linears to time")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per figure; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: the CPUs this process has)")
    parser.add_argument("--no-decode", action="store_true", help="skip the whole decode step (it loads SmolLM2)")
    parser.add_argument("--decode-steps", type=int, default=24, help="timed decode steps (their median counts)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt rows of the attention prefill figure")
    parser.add_argument("--context", type=int, default=2000, help="context of the attention decode figure")
    parser.add_argument("--out", type=Path, default=RESULTS / "roofline.json")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or max(args.rows) > 8192:
        parser.error("--rows must be 1-8192")
    if args.rounds < 1 or args.decode_steps < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--rounds, --decode-steps and --threads must be >= 1")
    if not 16 <= args.prompt <= 8192 or not 16 <= args.context <= 32768:
        parser.error("--prompt must be 16-8192 and --context 16-32768")
    return args


# -- the machine's limits ---------------------------------------------------------------------------


def build_probe(out_dir: Path) -> ctypes.CDLL:
    cc = cpu_kernels._compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang or $CC): the probes cannot be built")
    path = out_dir / "roofline_probe.so"
    flags = ["-O2", "-mavx2", "-mfma", "-fPIC", "-shared", "-pthread"]
    done = subprocess.run([cc, str(PROBE_SOURCE), "-o", str(path), *flags], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{cc} could not build the probes: {done.stderr.strip()[-500:]}")
    lib = ctypes.CDLL(str(path))
    lib.kvh_probe.restype = ctypes.c_double
    lib.kvh_probe.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    return lib


def measure_limits(lib: ctypes.CDLL, threads: int, rounds: int) -> dict:
    """Peak operations per second of each probe this CPU can run on `threads` cores, and read bytes
    per second (best of `rounds`, at least FMA_PROBES or READ_PROBES)."""
    flags = cpu_info().flags
    peaks = {}
    for name, kind in PROBES.items():
        if PROBE_FLAGS[name] <= flags:
            core = max(lib.kvh_probe(kind, 1, FMA_ROUNDS, None) for _ in range(max(rounds, FMA_PROBES)))
            peaks[name] = core * threads
    buf = np.ones(READ_BYTES // 4, dtype=np.float32)
    bandwidth = max(lib.kvh_probe(3, threads, buf.nbytes, buf.ctypes.data) for _ in range(max(rounds, READ_PROBES)))
    f32 = max(v for k, v in peaks.items() if k.endswith("_fma"))
    # The packed integer GEMM takes two int8 products per product (x's high and low bytes), so its
    # useful rate is at most half the VNNI dot's; "int16x" is that limit.
    int16x = peaks["avx512_vnni_dot"] / 2 if "avx512_vnni_dot" in peaks else None
    return {"peaks_flops": peaks, "float32_peak_flops": f32, "bfloat16_peak_flops": peaks.get("avx512_bf16_dot", f32),
            "int16x_peak_flops": int16x, "read_bytes_per_s": bandwidth}  # fmt: skip


# -- the linears ----------------------------------------------------------------------------------


def best_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm: packing, allocation, first touch
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_impls(kernels: cpu_kernels.CpuKernels | None, shape: str) -> dict[str, tuple[str, torch.dtype, Callable,
                                                                                           Callable]]:
    """name -> (the dtype whose peak binds it, the weight's form, weight -> what the call takes,
    y = call(x, prepared weight)). kvharbor's projections run the packed GEMM; its LM head (the
    tied embedding, kept unpacked) runs the dot-product kernel."""
    linear, same = torch.nn.functional.linear, lambda w: w
    impls: dict[str, tuple[str, torch.dtype, Callable, Callable]] = {
        "torch float32": ("float32", torch.float32, same, linear),
        "torch bfloat16": ("bfloat16", torch.bfloat16, same, lambda x, w: linear(x.bfloat16(), w)),
    }
    if kernels is None:
        return impls
    # bfloat16 weights: products in float32 FMAs, bound by the float32 peak, but half the bytes.
    if shape == "lm_head":
        impls["kvharbor dot float32"] = ("float32", torch.float32, same, kernels.linear)
        impls["kvharbor dot bf16 weights"] = ("float32", torch.bfloat16, same, kernels.linear_bf16)
    else:
        impls["kvharbor packed float32"] = ("float32", torch.float32, kernels.pack, kernels.linear_packed)
        impls["kvharbor packed bf16 weights"] = ("float32", torch.bfloat16, kernels.pack, kernels.linear_packed)
        if kernels.int_packs():  # q4 weights (int4, gguf's Q4_1), x as 16-bit codes: engine/quantize.py
            impls["kvharbor packed int q4"] = ("int16x", torch.float32, lambda w: kernels.pack_quant(quantize_int4(w)),
                                               kernels.linear_qpacked)  # fmt: skip
    return impls


# Weight bytes a few-row figure cycles through: four times the largest L3 seen here (32 MiB), so
# every call reads its weight from memory as a decode step does.
STREAM_BYTES = 128 << 20


def copies_for(m: int, weight_bytes: int) -> int:
    """Weights a figure cycles through: at few rows, STREAM_BYTES' worth, counted in the bytes the
    kernel reads. A fixed 30 (SmolLM2's layers) let the small k/v weight (442 KB) sit in the L3,
    and the packed GEMM then read 185% of the bandwidth bound; counted in float32 bytes, q4 copies
    (0.75 bytes a weight) fit the L3 too and read 106-119%. At many rows the work binds, and 2
    suffice."""
    return max(2, -(-STREAM_BYTES // weight_bytes)) if m <= 32 else 2


def measure_linears(args: argparse.Namespace, limits: dict, kernels) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            base = torch.randn(n, k, generator=gen) / k**0.5
            for name, (dtype, form, prepare, call) in linear_impls(kernels, shape).items():
                first = prepare(base.clone().to(form))  # clones: the values do not change the time
                ws = [first] + [prepare(base.clone().to(form)) for _ in range(copies_for(m, first.nbytes) - 1)]
                seconds = best_seconds(lambda x=x, ws=ws, call=call: [call(x, w) for w in ws], args.rounds) / len(ws)
                out.append(figure(shape, n, k, m, name, dtype, first.nbytes, seconds, limits))
    return out


def figure(shape: str, n: int, k: int, m: int, name: str, dtype: str, weight_bytes: int, seconds: float,
           limits: dict) -> dict:  # fmt: skip
    """One timed linear against its roofline (`weight_bytes`: the weight as the kernel reads it)."""
    flops = 2.0 * m * n * k
    act = 2 if dtype == "bfloat16" else 4
    nbytes = weight_bytes + act * m * (k + n)  # the weight once, x in, y out
    peak, bandwidth = limits[f"{dtype}_peak_flops"], limits["read_bytes_per_s"]
    bound = "compute" if flops / peak >= nbytes / bandwidth else "memory"
    return {"shape": shape, "n": n, "k": k, "rows": m, "kernel": name, "seconds": seconds,
            "gflops": flops / seconds / 1e9, "intensity": flops / nbytes, "bound": bound,
            "of_peak": flops / seconds / peak,
            "of_roofline": max(flops / peak, nbytes / bandwidth) / seconds}  # fmt: skip


# -- attention ------------------------------------------------------------------------------------

# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64; blocks of 16 slots.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def measure_attention(args: argparse.Namespace, limits: dict, kernels) -> list[dict]:
    """The paged attention kernel: one prompt's rows in tiles (batch-invariant prefill, bound by
    the cores) and 8 decode rows over long contexts in shuffled blocks, 30 layers' caches cycled
    so that K/V come from memory (bound by the bandwidth)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    n = args.prompt
    k = torch.randn(KV_HEADS, n + BLOCK, HEAD_DIM, generator=gen)
    v = torch.randn(KV_HEADS, n + BLOCK, HEAD_DIM, generator=gen)
    table = torch.arange((n + BLOCK) // BLOCK, dtype=torch.int32).repeat(n, 1)
    q, o = torch.randn(n, HEADS, HEAD_DIM, generator=gen), torch.empty(n, HEADS, HEAD_DIM)
    runs, lens = torch.tensor([0, n]), torch.arange(1, n + 1, dtype=torch.int32)
    seconds = best_seconds(lambda: kernels.decode_attention(q, k, v, table, lens, BLOCK, o, runs=runs), args.rounds)
    pairs = n * (n + 1) / 2 * HEADS
    out.append(attention_figure(f"prefill {n}", n, seconds, 4.0 * HEAD_DIM * pairs, 0.0, limits))
    ctx, seqs, layers = args.context, 8, 30
    blocks = seqs * (ctx // BLOCK + 1)
    caches = [(torch.randn(KV_HEADS, blocks * BLOCK, HEAD_DIM, generator=gen),
               torch.randn(KV_HEADS, blocks * BLOCK, HEAD_DIM, generator=gen)) for _ in range(layers)]  # fmt: skip
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(seqs, -1)
    q, o = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen), torch.empty(seqs, HEADS, HEAD_DIM)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    seconds = best_seconds(lambda: [kernels.decode_attention(q, kc, vc, tables, lens, BLOCK, o) for kc, vc in caches],
                        args.rounds) / layers  # fmt: skip
    kv_bytes = 2.0 * seqs * ctx * KV_HEADS * HEAD_DIM * 4
    out.append(attention_figure(f"decode 8x{ctx}", seqs, seconds, 4.0 * HEAD_DIM * seqs * ctx * HEADS, kv_bytes,
                                limits))  # fmt: skip
    return out


def attention_figure(shape: str, rows: int, seconds: float, flops: float, nbytes: float, limits: dict) -> dict:
    peak, bandwidth = limits["float32_peak_flops"], limits["read_bytes_per_s"]
    bound = "compute" if flops / peak >= nbytes / bandwidth else "memory"
    return {"shape": shape, "rows": rows, "kernel": "kvharbor attention float32", "seconds": seconds,
            "gflops": flops / seconds / 1e9, "bound": bound, "of_peak": flops / seconds / peak,
            "of_roofline": max(flops / peak, nbytes / bandwidth) / seconds}  # fmt: skip


# -- the decode step --------------------------------------------------------------------------------


def measure_decode(args: argparse.Namespace, limits: dict, threads: int) -> dict:
    """SmolLM2-135M, float32, batch-invariant, 8 requests decoding: the median step time against
    its weights read once at the measured bandwidth."""
    from kvharbor.engine import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="256MiB", threads=threads, progress=lambda _: None)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.decode_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=[(i * 97 + j * 13) % 40000 + 100 for j in range(24)])
    for _ in range(4):  # the prefills (chunked with the first decodes)
        engine.step()
    times = []
    for _ in range(args.decode_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    step = statistics.median(times)
    core = engine.core
    bound = core.weight_bytes / limits["read_bytes_per_s"]
    return {"model": core.model_name, "dtype": "float32", "batch_invariant": core.batch_invariant, "requests": 8,
            "weight_bytes": core.weight_bytes, "step_seconds": step, "bound_seconds": bound,
            "of_bandwidth_bound": bound / step}  # fmt: skip


# -- report ---------------------------------------------------------------------------------------------


def print_report(limits: dict, linears: list[dict], decode: dict | None, threads: int) -> None:
    print(f"{cpu_info().short()}; {threads} threads")
    for name, value in limits["peaks_flops"].items():
        print(f"  peak {name:16} {value / 1e9:8.1f} GFLOP/s")
    print(f"  read bandwidth        {limits['read_bytes_per_s'] / 1e9:8.1f} GB/s")
    print(f"\n{'shape':14} {'M':>5} {'kernel':32} {'ms':>8} {'GFLOP/s':>8} {'of peak':>8} {'bound':>8} "
          f"{'of roofline':>12}")  # fmt: skip
    for r in linears:
        print(f"{r['shape']:14} {r['rows']:>5} {r['kernel']:32} {r['seconds'] * 1e3:>8.3f} {r['gflops']:>8.1f} "
              f"{r['of_peak']:>7.0%} {r['bound']:>8} {r['of_roofline']:>11.0%}")  # fmt: skip
    if decode:
        print(
            f"\ndecode step, {decode['model']} {decode['dtype']}, {decode['requests']} requests: "
            f"{decode['step_seconds'] * 1e3:.2f} ms against {decode['bound_seconds'] * 1e3:.2f} ms to read "
            f"{decode['weight_bytes'] / 2**20:.0f} MiB of weights: {decode['of_bandwidth_bound']:.0%} of the bound"
        )


def plot(limits: dict, linears: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    bw = limits["read_bytes_per_s"]
    xs = np.logspace(-1, 3, 200)
    lines = [("float32 peak", limits["float32_peak_flops"], "-"),
             ("bfloat16 peak", limits["bfloat16_peak_flops"], "--"),
             ("16-bit x int8 dots peak", limits["int16x_peak_flops"], ":")]  # fmt: skip
    for label, peak, style in (line for line in lines if line[1]):
        ax.plot(xs, np.minimum(peak, xs * bw) / 1e9, style, color="gray", label=f"{label} ({peak / 1e9:.0f} GFLOP/s)")
    for kernel in dict.fromkeys(r["kernel"] for r in linears):
        pts = [r for r in linears if r["kernel"] == kernel]
        ax.scatter([r["intensity"] for r in pts], [r["gflops"] for r in pts], label=kernel, s=22)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte moved", ylabel="GFLOP/s",
           title=f"Linears against the roofline ({bw / 1e9:.0f} GB/s read)\n{machine_title()}")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or cpu_info().cores
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load(threads)
    with tempfile.TemporaryDirectory() as tmp:
        limits = measure_limits(build_probe(Path(tmp)), threads, args.rounds)
    linears = measure_linears(args, limits, kernels)
    attention = [] if kernels is None else measure_attention(args, limits, kernels)
    decode = None if args.no_decode else measure_decode(args, limits, threads)
    print_report(limits, linears + attention, decode, threads)
    record = {"benchmark": "roofline", "threads": threads, "rounds": args.rounds, "machine": machine_record(),
              "limits": limits, "linears": linears, "attention": attention, "decode": decode}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(limits, linears, png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
