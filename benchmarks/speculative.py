"""Speculative decoding on CPU with SmolLM2: output tok/s with speculation off, n-gram k=3 and
n-gram k=5, on a repetitive workload (rewrite a paragraph with one word changed; edit code) and
on open chat, with the acceptance rate and the mean accepted length.

    python benchmarks/speculative.py        # writes benchmarks/results/speculative.{json,png}

Requests run one at a time (a single user's latency is where speculation pays: a decode step
reads every weight for one token), greedy, so every configuration should write the same tokens;
the script reports whether they did. A second pass serves 24 requests of each workload 8 at a
time (continuous batching refills the batch as requests finish), where extra rows per step
cost more. Configurations are interleaved per prompt, and each prompt runs
`--repeats` times keeping the fastest, so load on this shared machine hits them alike. Ratios
are against speculation off, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvharbor.common.machine import machine_record, machine_title

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"off": None, "ngram k=3": 3, "ngram k=5": 5}

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the new budget. After a long debate, the members agreed "
    "to increase funding for public libraries and to repair the old bridge over the river before the winter.",
    "Our team released version two of the application last week. It starts faster, uses less memory, and fixes "
    "the bug that made the settings page crash when the language was changed.",
    "The museum will be closed on Monday for cleaning. Visitors can buy tickets online for the rest of the week, "
    "and children under twelve still enter for free when they come with an adult.",
]
CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
    "    return total\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def find_max(values):\n    best = values[0]\n    for value in values[1:]:\n        if value > best:\n"
    "            best = value\n    return best\n",
]
REPETITIVE = [f"Rewrite this paragraph with one word changed, and nothing else:\n\n{p}" for p in PARAGRAPHS] + [
    f"Rename the function to a better name and return the whole code, unchanged otherwise:\n\n{c}" for c in CODE
]
OPEN_CHAT = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me some ideas for a weekend trip near the mountains.",
    "What is the difference between a virus and a bacterium?",
    "How do I start learning to play the guitar?",
    "Write a short poem about autumn.",
]


def build(loaded, k: int | None, max_model_len: int, dtype: str):
    from kvharbor.engine import LLM

    spec = {"method": "ngram", "k": k, "ngram_n": 3} if k else {"method": "off"}
    memory = "256MiB"
    return LLM(loaded_model=loaded, dtype=dtype, kv_cache_memory=memory, max_model_len=max_model_len,
               max_num_seqs=8, speculative=spec)  # fmt: skip


def run_workload(llms: dict, prompts: list[str], max_tokens: int, repeats: int) -> dict[str, dict]:
    from kvharbor.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tok = next(iter(llms.values())).get_tokenizer()
    totals = {name: {"seconds": 0.0, "tokens": 0, "outputs": []} for name in llms}
    before = {name: _spec_counts(llm) for name, llm in llms.items()}
    for text in prompts:
        prompt = {"prompt_token_ids": tok.encode_chat([{"role": "user", "content": text}])}
        for name, llm in llms.items():
            best, out = float("inf"), None
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                best = min(best, time.perf_counter() - t0)
            totals[name]["seconds"] += best
            totals[name]["tokens"] += len(out.outputs[0].token_ids)
            totals[name]["outputs"].append(out.outputs[0].token_ids)
    report = {}
    for name, llm in llms.items():
        checks, proposed, accepted = (a - b for a, b in zip(_spec_counts(llm), before[name], strict=True))
        t = totals[name]
        report[name] = {
            "output_tok_s": t["tokens"] / t["seconds"],
            "output_tokens": t["tokens"],
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / checks if checks else None,
            "same_tokens_as_off": t["outputs"] == totals["off"]["outputs"],
        }
    base = report["off"]["output_tok_s"]
    for row in report.values():
        row["speedup"] = row["output_tok_s"] / base
    return report


def run_batched(llms: dict, prompts: list[str], max_tokens: int, total: int = 24) -> dict[str, dict]:
    """`total` requests submitted at once to engines that run 8 at a time: steady-state throughput."""
    from kvharbor.engine import SamplingParams

    tok = next(iter(llms.values())).get_tokenizer()
    variants = ["", " Please.", " Thanks!", " Be brief.", " In detail."]
    texts = [t + v for v in variants for t in prompts][:total]
    chats = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": t}])} for t in texts]
    report = {}
    for name, llm in llms.items():
        t0 = time.perf_counter()
        outs = llm.generate(chats, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        report[name] = {"output_tok_s": tokens / (time.perf_counter() - t0), "output_tokens": tokens}
    for row in report.values():
        row["speedup"] = row["output_tok_s"] / report["off"]["output_tok_s"]
    return report


def _spec_counts(llm) -> tuple[int, int, int]:
    s = llm.engine.core.stats
    return s.spec_verifications, s.spec_proposed, s.spec_accepted


def print_table(results: dict) -> None:
    print(f"{'workload':11} {'config':10} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'accepted/step':>13} {'same':>5}")
    for workload, rows in results.items():
        for name, r in rows.items():
            rate = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
            length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
            print(f"{workload:11} {name:10} {r['output_tok_s']:7.1f} {r['speedup']:7.2f}x {rate:>7} {length:>13} "
                  f"{'yes' if r['same_tokens_as_off'] else 'NO':>5}")  # fmt: skip


def report(llms: dict, results: dict, batched: dict) -> dict:
    """The JSON report: the runs, and the machine with the dtype the engines resolved (auto picks per CPU)."""
    dtype = str(next(iter(llms.values())).engine.core.dtype).removeprefix("torch.")
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_record(dtype),
        "results": results,
        "batched_8": batched,
    }


def plot(results: dict, dtype: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, name in enumerate(CONFIGS):
        xs = [w + (i - 1) * width for w in range(len(results))]
        ys = [rows[name]["output_tok_s"] for rows in results.values()]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, rows in zip(bars, results.values(), strict=True):
            ax.annotate(f"{rows[name]['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("output tok/s (one request at a time)")
    ax.set_title(f"SmolLM2 on CPU: n-gram speculative decoding\n{machine_title(dtype)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="runs per prompt and config; the fastest counts")
    parser.add_argument("--dtype", default="auto", help="auto (what serving uses), bfloat16 or float32")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json", help="JSON output (.png beside)")
    args = parser.parse_args(argv)
    from kvharbor.engine.model.loader import load_model

    print("[speculative] loading SmolLM2 ...", file=sys.stderr)
    loaded = load_model(None)
    llms = {name: build(loaded, k, 2048, args.dtype) for name, k in CONFIGS.items()}
    results = {}
    for workload, prompts in (("repetitive", REPETITIVE), ("open chat", OPEN_CHAT)):
        print(f"[speculative] {workload}: {len(prompts)} prompts x {len(llms)} configs ...", file=sys.stderr)
        results[workload] = run_workload(llms, prompts, args.max_tokens, args.repeats)
    batched = {}
    for workload, prompts in (("repetitive", REPETITIVE), ("open chat", OPEN_CHAT)):
        print(f"[speculative] {workload}: 24 requests, 8 at a time, x {len(llms)} configs ...", file=sys.stderr)
        batched[workload] = run_batched(llms, prompts, args.max_tokens)
    print_table(results)
    print("24 requests, 8 at a time:")
    for workload, rows in batched.items():
        print("  " + workload + ": " + ", ".join(f"{n} {r['output_tok_s']:.1f} tok/s ({r['speedup']:.2f}x)"
                                                  for n, r in rows.items()))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = report(llms, results, batched)
    args.out.write_text(json.dumps(summary, indent=2))
    plot(results, summary["machine"]["dtype"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
