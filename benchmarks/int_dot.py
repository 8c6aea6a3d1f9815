"""The quantized decode products with and without this CPU's VNNI instruction, in the same run.

engine/cpu/csrc/cpu_kernels.c sums a group's 32 u8 x s8 products with one `vpdpbusd` where the build
has VNNI (AVX-VNNI, or AVX512-VNNI's 256-bit form: engine/cpu/cpu_kernels.py vnni_flags), and with
AVX2's maddubs + madd otherwise. Both builds are made here from the same source and timed on the
same weights: every linear of SmolLM2's 30 layers (q, k, v, o, gate, up, down; random values, the
shapes are what matter) in each weight format with integer dots (int8, int4 / GGUF Q4_x, GGUF Q8_0),
at 1 and 8 rows. The baseline is the maddubs build; times are the best of `--rounds` rounds, the
two builds alternating. Prints a table, writes benchmarks/results/int_dot.json with the machine.

    python benchmarks/int_dot.py [--rows 1 8] [--layers 30] [--rounds 15]
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvharbor.common.machine import cpu_info, machine_record
from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.quantize import quantize, quantize_q8

RESULTS = Path(__file__).resolve().parent / "results"
# SmolLM2-135M's linears per layer, [out, in]: q, k, v, o, gate, up, down.
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
MODES = ("int8", "int4", "q8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows per product (decode batch)")
    parser.add_argument("--layers", type=int, default=30, help="layers of SmolLM2's shapes")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per build; the best counts")
    parser.add_argument("--out", type=Path, default=RESULTS / "int_dot.json")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or max(args.rows) > 32 or args.layers < 1 or args.rounds < 1:
        parser.error("--rows must be 1-32 (the integer-dot kernel's range), --layers and --rounds >= 1")
    return args


def builds(out_dir: Path) -> tuple[cpu_kernels.CpuKernels, cpu_kernels.CpuKernels] | None:
    """The maddubs build and this CPU's VNNI build, or None (with the reason printed)."""
    extra = cpu_kernels.vnni_flags(cpu_info())
    cc = cpu_kernels._compiler()
    if not extra or cc is None:
        print("this CPU has no VNNI (or no C compiler is found): nothing to compare", file=sys.stderr)
        return None
    plain = cpu_kernels.CpuKernels(cpu_kernels.build(cc, out_dir), 2)
    return plain, cpu_kernels.CpuKernels(cpu_kernels.build(cc, out_dir, (*cpu_kernels.FLAGS, *extra)), 2)


def time_products(kernels: cpu_kernels.CpuKernels, layers: list, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        for w in layer:
            kernels.linear_quant(xs[w.k], w)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, plain: cpu_kernels.CpuKernels, vnni: cpu_kernels.CpuKernels) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for mode in MODES:
        dense = [[torch.randn(n, k, generator=gen) for n, k in SHAPES] for _ in range(args.layers)]
        layers = [[quantize_q8(w) if mode == "q8" else quantize(w, mode) for w in layer] for layer in dense]
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
            base = fast = float("inf")
            for _ in range(args.rounds):  # the two builds alternate, so drift hits both alike
                base = min(base, time_products(plain, layers, xs))
                fast = min(fast, time_products(vnni, layers, xs))
            rows_out.append({"mode": mode, "rows": rows, "maddubs_ms": base * 1e3, "vnni_ms": fast * 1e3,
                             "speedup": base / fast})  # fmt: skip
    return rows_out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pair = builds(Path(tmp))
        if pair is None:
            return 2
        vnni_name = pair[1].int_dot
        results = measure(args, *pair)
    print(f"{args.layers} layers of SmolLM2's linears; best of {args.rounds}; {cpu_info().short()}")
    print(f"{'mode':6} {'rows':>4} {'maddubs ms':>11} {vnni_name + ' ms':>16} {'speed-up':>9}")
    for r in results:
        print(f"{r['mode']:6} {r['rows']:>4} {r['maddubs_ms']:>11.2f} {r['vnni_ms']:>16.2f} {r['speedup']:>8.2f}x")
    record = {"benchmark": "int_dot", "vnni": vnni_name, "layers": args.layers, "rounds": args.rounds,
              "machine": machine_record("float32"), "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
