"""What runs fastest on this CPU, measured at start-up: `--dtype auto`'s dtype, and (with
`--batch-invariant off`) who runs float32 prefill rows, kvharbor's packed GEMM or oneDNN.

Why measure: the rule it replaces (common/machine.py `CpuInfo.fast_bf16`, now the fallback where
the kernels cannot run) was fitted to the kernels of its day on two CPUs. Since the packed GEMM
(engine/cpu/csrc/packed_gemm.c), bfloat16 weights cost float32's time at prefill sizes on any
AVX2 CPU and half its bytes at decode sizes, and oneDNN's speed differs by CPU (AMX, AVX512-BF16,
AVX2). A CPU no session has seen is decided by what it does, not by a guess.

The probe times SmolLM2-135M's gate/up and down projections, each candidate:
- at PREFILL_ROWS rows (bound by the cores), and
- at DECODE_ROWS rows, cycling through STREAM_BYTES of weights so that they come from memory as a
  decode step's do.
A candidate's cost is one turn of chat: a prompt's prefill plus DECODE_STEPS decode steps.
bfloat16 must beat float32 by BF16_MARGIN, since it costs accuracy (a mean KL of ~1e-4 on
SmolLM2). About 0.1 s.

The figures are measured once per machine, not once per process: they are kept in
$KVHARBOR_CACHE_DIR/kernel-probe/ under a name that hashes what they depend on (the CPU's model
and flags, the threads, the mode, the kernels' build and torch's version), and every later engine
of that machine reads them. On a busy machine a fresh probe could choose differently from one
start to the next (a full test suite's load once moved bfloat16's turn from 0.7x to > 0.9x
float32's), and engines of one model on one machine must agree on the dtype: their KV blocks
carry it, and blocks of another dtype are never imported. Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kvharbor.engine.cpu.kernel_probe")

SHAPES = ((3072, 576), (576, 1536))  # SmolLM2-135M's fused gate/up and down, [out, in]
PREFILL_ROWS, DECODE_ROWS = 128, 8
DECODE_STEPS = 16  # a turn: one 128-token prompt, then its share of decode steps at 8 requests
STREAM_BYTES = 64 << 20  # float32 weights cycled at decode sizes: past the L3 of every CPU seen here
BF16_MARGIN = 0.9  # bfloat16 only when its turn takes at most this much of float32's
ONEDNN_MARGIN = 0.95  # oneDNN's prefill only when it takes at most this much of kvharbor's time
ROUNDS = 3  # the best of these counts


@dataclass(frozen=True)
class Figures:
    """Seconds per candidate (its name: "<who> <dtype>"): one pass of SHAPES at PREFILL_ROWS, and
    at DECODE_ROWS with the weights from memory."""

    prefill: dict[str, float]
    decode: dict[str, float]

    def turn(self, name: str) -> float:
        return self.prefill[name] + DECODE_STEPS * self.decode[name]

    def line(self) -> str:
        """The figures as a log line: GFLOP/s at prefill rows, GB/s of float32-equivalent weights at decode rows."""
        flops = sum(2.0 * PREFILL_ROWS * n * k for n, k in SHAPES)
        return "; ".join(f"{name}: prefill {flops / self.prefill[name] / 1e9:.0f} GFLOP/s, decode turn "
                         f"{self.turn(name) * 1e3:.2f} ms" for name in self.prefill)  # fmt: skip


@dataclass(frozen=True)
class Choice:
    dtype: str  # "float32" or "bfloat16"
    prefill: str  # who runs float32 prefill rows with the mode off: "kvharbor" or "onednn"
    why: str


def choose(figures: Figures, invariant: bool) -> Choice:
    """The dtype and the float32 prefill kernel these figures call for. Batch-invariant engines
    run kvharbor's kernels in either dtype; with the mode off each dtype takes its faster one."""

    def best(dtype: str) -> str | None:
        # What an engine of this mode would run: invariant engines kvharbor's kernels; with the
        # mode off float32 either, bfloat16 oneDNN's (or F.linear where oneDNN does not run: not
        # measured, so not chosen), never the packed GEMM.
        if invariant:
            runs = [f"kvharbor {dtype}"]
        else:
            runs = ["kvharbor float32", "onednn float32"] if dtype == "float32" else ["onednn bfloat16"]
        names = [n for n in runs if n in figures.prefill]
        return min(names, key=figures.turn) if names else None

    f32, bf16 = best("float32"), best("bfloat16")
    if bf16 is None:
        return Choice("float32", _prefill(figures), "no bfloat16 kernel measured for this mode")
    ratio = figures.turn(bf16) / figures.turn(f32)
    dtype = "bfloat16" if ratio <= BF16_MARGIN else "float32"
    prefill = _prefill(figures)
    why = (f"a turn in bfloat16 ({bf16}) takes {ratio:.2f}x float32's ({f32}); bfloat16 needs "
           f"<= {BF16_MARGIN}x")  # fmt: skip
    return Choice(dtype, prefill, why)


def _prefill(figures: Figures) -> str:
    onednn, ours = figures.prefill.get("onednn float32"), figures.prefill["kvharbor float32"]
    return "onednn" if onednn is not None and onednn <= ONEDNN_MARGIN * ours else "kvharbor"


def measure(kernels, onednn: bool) -> Figures:
    """Time the candidates here: kvharbor's packed GEMM in float32 and bfloat16 (in k-pairs where
    the CPU has AVX512-BF16), and oneDNN's
    packed linears where `onednn` (engine/cpu/cpu_linear.py finds them usable)."""
    from kvharbor.engine.cpu import cpu_linear

    makers: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
        "kvharbor float32": lambda w: _packed(kernels, w),
        "kvharbor bfloat16": lambda w: _packed(kernels, w.bfloat16(), dot=kernels.bf16_dot()),
    }
    if onednn:
        makers["onednn float32"] = lambda w: _onednn(cpu_linear, w, torch.float32)
        makers["onednn bfloat16"] = lambda w: _onednn(cpu_linear, w, torch.bfloat16)
    # Constant weights: the time does not depend on the values, and filling is far cheaper than randn.
    per_copy = sum(n * k * 4 for n, k in SHAPES)
    copies = max(2, STREAM_BYTES // per_copy)
    linears = {name: [[make(torch.full((n, k), 0.01)) for n, k in SHAPES] for _ in range(copies)]
               for name, make in makers.items()}  # fmt: skip
    prefill = _interleaved({name: _pass(ls[:1], PREFILL_ROWS) for name, ls in linears.items()})
    decode = _interleaved({name: _pass(ls, DECODE_ROWS) for name, ls in linears.items()})
    return Figures(prefill, {name: seconds / copies for name, seconds in decode.items()})


def _packed(kernels, w: torch.Tensor, dot: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = kernels.pack(w, dot=dot)  # as the engine packs it (cpu_linear._invariant_linears)
    return lambda x: kernels.linear_packed(x, packed)


def _onednn(cpu_linear, w: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = cpu_linear.pack(w.to(dtype))
    return lambda x: cpu_linear.packed_linear(x.to(dtype), packed, None)


def _pass(linears: list[list[Callable]], rows: int) -> Callable[[], None]:
    inputs = [torch.full((rows, k), 0.5) for _, k in SHAPES]

    def one_pass() -> None:
        for layer in linears:
            for fn, x in zip(layer, inputs, strict=True):
                fn(x)

    return one_pass


def _interleaved(passes: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Each candidate's best of ROUNDS, the candidates taking turns within each round, so a burst
    of a neighbour's load falls on all of them, not on one. (Timed one candidate after another,
    an engine in a full test suite here once got float32 where the probe alone gives bfloat16
    0.66-0.71x float32's turn.)"""
    for one_pass in passes.values():
        one_pass()  # warm: first touch, oneDNN's primitive
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(ROUNDS):
        for name, one_pass in passes.items():
            start = time.perf_counter()
            one_pass()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@cache
def probed(threads: int, invariant: bool) -> Choice | None:
    """This machine's choice: its figures read from the cache, or measured and kept there (None
    where kvharbor's kernels do not run here)."""
    from kvharbor.engine.cpu import cpu_kernels, cpu_linear

    kernels = cpu_kernels.load(threads)
    if kernels is None:
        return None
    path = cache_path(kernels, threads, invariant)
    figures = _read(path)
    source = f"measured at {path}"
    if figures is None:
        onednn = not invariant and cpu_linear.packing_available(torch.bfloat16, torch.device("cpu"))
        figures = measure(kernels, onednn)
        source = f"measured now, kept at {path}" if _keep(path, figures) else "measured now"
    choice = choose(figures, invariant)
    log.info("dtype auto: %s (%s); %s: %s", choice.dtype, choice.why, source, figures.line(),
             extra={"dtype": choice.dtype, "prefill": choice.prefill})  # fmt: skip
    return choice


def cache_path(kernels, threads: int, invariant: bool) -> Path:
    """Where this machine's figures are kept: named by what they depend on."""
    from kvharbor.common.machine import cpu_info
    from kvharbor.engine.cpu.cpu_kernels import cache_dir

    cpu = cpu_info()
    key = [cpu.model, sorted(cpu.flags), threads, invariant, kernels.path.name, torch.__version__]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return cache_dir() / "kernel-probe" / f"{digest}.json"


def _read(path: Path) -> Figures | None:
    """The kept figures, or None where there are none or they cannot be read (measured again)."""
    try:
        data = json.loads(path.read_text())
        figures = Figures(dict(data["prefill"]), dict(data["decode"]))
        seconds = [*figures.prefill.values(), *figures.decode.values()]
        if figures.prefill.keys() != figures.decode.keys() or "kvharbor float32" not in figures.prefill:
            raise ValueError("not the figures of every candidate")
        if not all(isinstance(v, float) and v > 0 for v in seconds):
            raise ValueError("a time that is not a positive number")
        return figures
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the kept kernel probe at %s cannot be read (%s): measuring again", path, exc)
        return None


def _keep(path: Path, figures: Figures) -> bool:
    """Write the figures whole or not at all (another engine may be reading); False where the
    cache cannot be written (a read-only home): the figures still serve this process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(asdict(figures)))
        os.replace(part, path)
        return True
    except OSError as exc:
        log.warning("could not keep the kernel probe's figures at %s (%s): later engines measure again", path, exc)
        return False
