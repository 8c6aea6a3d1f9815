"""Where a decode step's milliseconds go, in the offline engine: the bundled SmolLM2, BATCH
sequences of PROMPT tokens decoding OUTPUT tokens each (the shape of compare_peers.py's rows).

Two engines are measured in the same run, one after the other:
- `baseline`: `--cpu-kernels off`, plain torch (F.linear through MKL, gather + SDPA attention),
  which is what the engine ran before issue 15;
- `kvharbor`: the default, with the AVX2 decode kernels (engine/cpu/csrc/cpu_kernels.c) and the
  oneDNN-packed prefill linears.

Each decode step is split by timers wrapped around the engine's own functions: the projections
(`model._linear`), attention (`model.paged_attention`), the LM head (`LlamaModel.logits`),
sampling, scheduling, update, and input preparation; `other` is the rest of the step (norms,
RoPE, SiLU, residual adds, output building, Python). The timers cost about a microsecond per
call (~150 calls a step), well under 1% of a step here. torch.profiler cannot see inside the
ctypes kernels, which is why timers and not the profiler give this table; `--torch-profile`
adds torch.profiler's own top ops for each engine. Prints a table, writes
benchmarks/results/profile_step.{json,png} with the machine it ran on.

    python benchmarks/profile_step.py [--batch 8] [--prompt 128] [--output 64] [--dtype float32]
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine import runner as runner_module
from kvharbor.engine.model import decoder as model_module
from kvharbor.engine.model.decoder import LlamaModel
from kvharbor.engine.quantize import QUANTIZATIONS
from kvharbor.engine.runner import ModelRunner
from kvharbor.engine.sampler import Sampler
from kvharbor.engine.scheduler import Scheduler

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("linears", "attention", "lm_head", "sampling", "schedule", "update", "inputs", "other")


class Timers:
    """Accumulated seconds per part while `active`; patched functions report into it. Only the
    outermost timed call counts: the LM head's matmul is lm_head, not linears."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.active or self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self._depth -= 1

        self._saved.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def install(timers: Timers) -> None:
    timers.wrap(model_module, "_linear", "linears")
    timers.wrap(model_module, "paged_attention", "attention")
    timers.wrap(LlamaModel, "logits", "lm_head")
    timers.wrap(Sampler, "sample", "sampling")
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(Scheduler, "update", "update")
    timers.wrap(ModelRunner, "_inputs", "inputs")
    timers.wrap(runner_module, "build_metadata", "inputs")


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 20000, (batch, length), generator=g).tolist()


def profile(label: str, args: argparse.Namespace) -> dict:
    quantization = args.quantization if label == "kvharbor" else "none"
    llm = LLM(args.model, dtype=args.dtype, cpu_kernels=label == "kvharbor", quantization=quantization,
              max_model_len=1024, num_kv_blocks=512)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(args.batch, args.prompt, 0), params)  # warm-up: first steps are slower
    timers = Timers()
    install(timers)
    try:
        for i, ids in enumerate(prompts(args.batch, args.prompt, 1)):
            engine.add_request(f"p{i}", prompt_token_ids=ids, params=params)
        while engine.core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running
        ):
            engine.step()  # the prefills, untimed
        steps, total = 0, 0.0
        while engine.has_unfinished():
            timers.active = True
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            timers.active = False
            steps += 1
        torch_top = _torch_profile(llm, params, args) if args.torch_profile else []
    finally:
        timers.restore()
    step_ms = 1000 * total / steps
    parts = {p: 1000 * timers.seconds[p] / steps for p in PARTS if p != "other"}
    parts["other"] = max(0.0, step_ms - sum(parts.values()))
    return {"label": label, "steps": steps, "step_ms": step_ms, "parts_ms": parts, "torch_top": torch_top}


def _torch_profile(llm: LLM, params: SamplingParams, args: argparse.Namespace) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts(args.batch, args.prompt, 2), params)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
    return [
        {"op": e.key, "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total} for e in rows
    ]


def table(results: list[dict]) -> str:
    head = f"{'part':<10}" + "".join(f"{r['label'] + ' ms':>16}{'share':>8}" for r in results)
    lines = [head]
    for part in PARTS:
        cells = "".join(f"{r['parts_ms'][part]:>16.2f}{r['parts_ms'][part] / r['step_ms']:>8.0%}" for r in results)
        lines.append(f"{part:<10}{cells}")
    lines.append(f"{'step':<10}" + "".join(f"{r['step_ms']:>16.2f}{'':>8}" for r in results))
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(results)
    for part in PARTS:
        values = [r["parts_ms"][part] for r in results]
        ax.bar([r["label"] for r in results], values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--output", type=int, default=64, help="output tokens per sequence")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="the kvharbor row's weights (the torch row stays float)",
    )
    parser.add_argument("--torch-profile", action="store_true", help="also list torch.profiler's top ops")
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_step.json")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.prompt < 1 or args.output < 2:
        parser.error("--batch and --prompt must be >= 1 and --output >= 2")
    results = [profile("baseline", args), profile("kvharbor", args)]
    machine = machine_record(args.dtype)
    shape = f"{args.batch} x ({args.prompt} prompt + {args.output} output) tokens"
    print(f"decode step of {shape}, {machine_title(args.dtype)}")
    print(table(results))
    print(f"kvharbor / baseline step time: {results[1]['step_ms'] / results[0]['step_ms']:.2f}x")
    for r in results:
        for row in r["torch_top"]:
            print(f"  {r['label']:<9} {row['op']:<40} {row['self_ms']:>9.1f} ms {row['share']:>6.0%}")
    record = {"benchmark": "profile_step", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results, "step_ratio": results[1]["step_ms"] / results[0]["step_ms"]}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    plot(results, args.out.with_suffix(".png"), f"decode step, {args.batch} sequences — {machine_title(args.dtype)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
