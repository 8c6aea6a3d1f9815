"""What batch-invariant mode costs: the offline engine's output tok/s, TTFT and ITL with
--batch-invariant off and on, at concurrency 1 and 8, in float32 and bfloat16, on SmolLM2.

Workload (as compare_peers.py's): requests of --prompt-tokens prompt tokens (distinct seeded ids,
no shared prefix) and --output-tokens greedy output tokens (EOS ignored); at concurrency C the
engine holds C requests and takes the next as one finishes. Both modes load the same weights; each
round measures every (dtype, concurrency, mode) in turn and the best round is kept, so this shared
machine's drift hits both modes alike. The ratio on / off is the cost.

    python benchmarks/batch_invariant.py [--dtypes float32,bfloat16] [--rounds 3]

Prints a table, writes benchmarks/results/batch_invariant.{json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.model.loader import load_model

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("off", "on")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, work: list[list[int]], concurrency: int, output_tokens: int) -> dict:
    """Serve `work` keeping `concurrency` requests in the engine; time every token as it appears."""
    engine, params = llm.engine, SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    waiting = list(enumerate(work))
    start: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    while waiting or engine.has_unfinished():
        while waiting and sum(1 for r in stamps if len(stamps[r]) < output_tokens) < concurrency:
            i, prompt = waiting.pop(0)
            rid = f"r{i}"
            start[rid], stamps[rid] = time.perf_counter(), []
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        for out in engine.step():
            stamps[out.request_id] += [time.perf_counter()] * len(out.outputs[0].delta_token_ids)
    wall = time.perf_counter() - t0
    ttft = [stamps[r][0] - start[r] for r in stamps]
    itl = [b - a for s in stamps.values() for a, b in itertools.pairwise(s)]
    tokens = sum(len(s) for s in stamps.values())
    return {"output_tok_s": tokens / wall, "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "itl_mean_ms": statistics.fmean(itl) * 1e3, "wall_s": wall}  # fmt: skip


def measure(args: argparse.Namespace) -> list[dict]:
    loaded = load_model(args.model)
    vocab = loaded.arch.vocab_size
    best: dict[tuple[str, int, str], dict] = {}
    for dtype in args.dtypes:
        llms = {m: LLM(loaded_model=loaded, dtype=dtype, batch_invariant=m, max_model_len=1024, num_kv_blocks=1024)
                for m in MODES}  # fmt: skip
        assert [llms[m].engine.core.batch_invariant for m in MODES] == [False, True]
        for i in range(args.rounds):
            for c in (1, 8):
                # new prompts each round: a round repeating the last one's would hit the prefix cache
                work = prompts(c * args.requests_per_slot, args.prompt_tokens, vocab, seed=1000 * i + c)
                for mode in MODES:
                    got = run(llms[mode], work, c, args.output_tokens)
                    key = (dtype, c, mode)
                    if key not in best or got["output_tok_s"] > best[key]["output_tok_s"]:
                        best[key] = got
                    print(f"  {dtype} c={c} {mode}: {got['output_tok_s']:.1f} tok/s", flush=True)
    rows = []
    for dtype in args.dtypes:
        for c in (1, 8):
            off, on = best[(dtype, c, "off")], best[(dtype, c, "on")]
            rows.append({"dtype": dtype, "concurrency": c, "off": off, "on": on,
                         "ratio": on["output_tok_s"] / off["output_tok_s"]})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'dtype':<10}{'conc':>5}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}{'TTFT p50 off/on ms':>21}"
             f"{'ITL off/on ms':>16}"]  # fmt: skip
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append(
            f"{r['dtype']:<10}{r['concurrency']:>5}{off['output_tok_s']:>11.1f}{on['output_tok_s']:>10.1f}"
            f"{r['ratio']:>8.3f}{off['ttft_p50_ms']:>11.0f} / {on['ttft_p50_ms']:<7.0f}"
            f"{off['itl_mean_ms']:>8.1f} / {on['itl_mean_ms']:<6.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['dtype']}\nc={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["off"]["output_tok_s"] for r in rows], width=0.4, label="off")
    ax.bar([x + 0.2 for x in xs], [r["on"]["output_tok_s"] for r in rows], width=0.4, label="batch-invariant")
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(f"{r['ratio']:.2f}x", (x + 0.2, r["on"]["output_tok_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tok/s")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each (dtype, concurrency, mode) keeps its best")
    parser.add_argument("--out", type=Path, default=RESULTS / "batch_invariant.json")
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or set(args.dtypes) - {"float32", "bfloat16"}:
        parser.error("--dtypes takes float32 and/or bfloat16")
    if min(args.prompt_tokens, args.output_tokens, args.requests_per_slot, args.rounds) < 1:
        parser.error("--prompt-tokens, --output-tokens, --requests-per-slot and --rounds must be >= 1")
    rows = measure(args)
    print(f"batch-invariant mode's cost, {machine_title()}")
    print(table(rows))
    record = {"benchmark": "batch_invariant", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": machine_record(), "workload": {k: getattr(args, k) for k in
              ("prompt_tokens", "output_tokens", "requests_per_slot", "rounds")}, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    plot(rows, args.out.with_suffix(".png"), f"batch-invariant mode, SmolLM2 — {machine_title()}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
