"""What `dtype=auto` should pick on this CPU: bfloat16 against float32, measured in one run, for
plain weights and for each quantization, on SmolLM2 (issue 22: "measure the rule; do not assume
it"). common/machine.py's CpuInfo.fast_bf16 is the rule; this checks it against the figures.

For each (weights, dtype), one offline engine with its defaults (batch-invariant mode where
`auto` turns it on), both warmed up, then float32 and bfloat16 measured alternately in each round,
each figure's best round kept (this machine is shared and noisy):
- decode: output tok/s at concurrency 1 and 8 (batch_invariant.py's loop), --prompt-tokens
  prompts and --output-tokens greedy tokens, EOS ignored;
- cold prefill: the time to the first token of one prompt of 128 and of 512 tokens, alone, with
  ids no earlier prompt shared (so no prefix-cache hit).
The verdict per weights: bfloat16 is faster when it wins both decode concurrencies and its
prefill is no more than 10% slower; `auto` should then pick it.

    python benchmarks/dtype_auto.py [--weights none,gguf,int8] [--rounds 2]

Prints a table, writes benchmarks/results/dtype_auto.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_invariant import prompts, run

from kvharbor.common.machine import CpuInfo, auto_cpu_dtype, machine_record, machine_title
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.model.loader import load_model

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = ("float32", "bfloat16")
WEIGHTS = ("none", "gguf", "int8", "int4")
PREFILLS = (128, 512)
PREFILL_SLACK = 1.10  # bfloat16's cold prefill may be this much slower and still win
FIGURES = ("decode_c1", "decode_c8", *(f"prefill_{n}_ms" for n in PREFILLS))  # what each (weights, dtype) gets


def cold_prefill_ms(llm: LLM, length: int, vocab: int, rng: random.Random) -> float:
    prompt = [rng.randrange(100, vocab) for _ in range(length)]
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return (time.perf_counter() - t0) * 1e3


def measure_weights(quantization: str, args: argparse.Namespace) -> dict:
    loaded = load_model(None, keep_blocks=quantization == "gguf")
    vocab = loaded.arch.vocab_size
    work = {c: prompts(c * args.requests_per_slot, args.prompt_tokens, vocab, seed=c) for c in (1, 8)}
    llms = {d: LLM(loaded_model=loaded, dtype=d, quantization=quantization, max_model_len=1024, num_kv_blocks=1024)
            for d in DTYPES}  # fmt: skip
    rng = random.Random(0)
    for llm in llms.values():  # warm-up: the first steps of each shape pay for kernels and buffers
        run(llm, prompts(8, args.prompt_tokens, vocab, seed=99), 8, 8)
        cold_prefill_ms(llm, max(PREFILLS), vocab, rng)
    best: dict[str, dict] = {d: {} for d in DTYPES}
    for _ in range(args.rounds):
        for dtype, llm in llms.items():
            got = {f"decode_c{c}": run(llm, work[c], c, args.output_tokens)["output_tok_s"] for c in (1, 8)}
            got |= {f"prefill_{n}_ms": cold_prefill_ms(llm, n, vocab, rng) for n in PREFILLS}
            for key, value in got.items():
                better = max if key.startswith("decode") else min
                best[dtype][key] = better(value, best[dtype].get(key, value))
            print(f"  {quantization} {dtype}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    return verdict(quantization, best["float32"], best["bfloat16"])


def verdict(quantization: str, f32: dict, bf16: dict, cpu: CpuInfo | None = None) -> dict:
    """The row of one weight kind: bfloat16's speed as a multiple of float32's for each figure (>1:
    bfloat16 wins), which dtype is faster by the module's criterion, and whether `auto` (on `cpu`,
    default this machine) picks it."""
    ratios = {k: (bf16[k] / f32[k] if k.startswith("decode") else f32[k] / bf16[k]) for k in f32}
    faster = all(ratios[f"decode_c{c}"] > 1 for c in (1, 8)) and all(
        ratios[f"prefill_{n}_ms"] >= 1 / PREFILL_SLACK for n in PREFILLS
    )
    measured = "bfloat16" if faster else "float32"
    auto = auto_cpu_dtype(cpu, quantized=quantization != "none")
    return {"weights": quantization, "float32": f32, "bfloat16": bf16, "bf16_over_f32": ratios,
            "faster": measured, "auto_picks": auto, "rule_holds": measured == auto}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [f"{'weights':<8}{'measure':<15}{'float32':>9}{'bfloat16':>10}{'bf16 x':>8}", "-" * 50]
    for r in rows:
        for k in FIGURES:
            lines.append(f"{r['weights']:<8}{k:<15}{r['float32'][k]:>9.1f}{r['bfloat16'][k]:>10.1f}"
                         f"{r['bf16_over_f32'][k]:>8.2f}")  # fmt: skip
        holds = "holds" if r["rule_holds"] else "DOES NOT HOLD"
        lines.append(f"{'':<8}faster: {r['faster']}; auto picks {r['auto_picks']} (rule {holds})")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(FIGURES)
    for i, k in enumerate(FIGURES):
        xs = [j + (i - (len(FIGURES) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["bf16_over_f32"][k] for r in rows], width=width, label=k.replace("_ms", ""))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['weights']}\nauto: {r['auto_picks']}" for r in rows])
    ax.set_ylabel("bfloat16 speed / float32's")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="none,gguf,int8", help=f"comma-separated, of {', '.join(WEIGHTS)}")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2, help="decode requests per concurrency slot")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each figure keeps its best")
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype_auto.json")
    args = parser.parse_args(argv)
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not weights or set(weights) - set(WEIGHTS):
        parser.error(f"--weights takes {', '.join(WEIGHTS)}")
    if min(args.prompt_tokens, args.output_tokens, args.requests_per_slot, args.rounds) < 1:
        parser.error("--prompt-tokens, --output-tokens, --requests-per-slot and --rounds must be >= 1")
    rows = [measure_weights(w, args) for w in weights]
    print(f"bfloat16 against float32, SmolLM2, {machine_title()}")
    print(table(rows))
    record = {"benchmark": "dtype_auto", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_record(),
              "workload": {k: getattr(args, k) for k in ("prompt_tokens", "output_tokens", "requests_per_slot",
              "rounds")} | {"prefill_tokens": list(PREFILLS)}, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    plot(rows, args.out.with_suffix(".png"), f"dtype=auto's rule, SmolLM2 — {machine_title()}")
    print(f"wrote {args.out}")
    return 0 if all(r["rule_holds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
