"""Engine throughput on CPU with SmolLM2, against baselines measured in the same run.

1. Mixed workload: 64 requests, prompts of 64-512 tokens, outputs of 16-256 tokens, all queued
   at once. kvharbor (continuous batching) vs Hugging Face `generate` with static batches of the
   same prompts (left-padded; a batch runs until its longest output). Figures: output tok/s,
   total tok/s, TTFT p50/p95, ITL p50/p95, and the throughput ratio.
2. Shared-prefix workload: 32 requests sharing a 1,024-token prefix (+ a short unique suffix).
   TTFT with prefix caching on and off, all queued at once and one at a time, as ratios.

Prints a table, writes benchmarks/results/engine_throughput.json and a PNG plot.
Usage: python benchmarks/engine_throughput.py [--quick] [--hf-batch 16] [--dtype auto]
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.model.loader import load_model

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def mixed_workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))], rng.randint(16, 256)) for _ in range(n)]


def run_engine(llm: LLM, work: list[tuple[list[int], int]], sequential: bool = False) -> dict:
    """Queue `work` (all at once, or one after another) and time every token as it appears."""
    engine = llm.engine
    start: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    batches = [[i] for i in range(len(work))] if sequential else [list(range(len(work)))]
    for batch in batches:
        for i in batch:
            prompt, out_len = work[i]
            rid = f"r{i}"
            start[rid] = time.perf_counter()
            stamps[rid] = []
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                stamps[out.request_id] += [now] * len(out.outputs[0].delta_token_ids)
    wall = time.perf_counter() - t0
    ttft = [stamps[r][0] - start[r] for r in stamps]
    itl = [b - a for r in stamps for a, b in zip(stamps[r], stamps[r][1:], strict=False)]
    out_tokens = sum(len(s) for s in stamps.values())
    in_tokens = sum(len(p) for p, _ in work)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + in_tokens) / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p95_s": pct(ttft, 95),
        "ttft_mean_s": statistics.fmean(ttft),
        "itl_p50_s": pct(itl, 50),
        "itl_p95_s": pct(itl, 95),
        "preemptions": engine.core.scheduler.num_preemptions,
    }


def run_hf_static(model, work: list[tuple[list[int], int]], batch_size: int) -> dict:
    """HF generate over consecutive static batches; counts only the tokens each request asked for."""
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    useful = 0
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        steps = max(n for _, n in batch)
        gen = GenerationConfig(
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=2, eos_token_id=None
        )
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        useful += sum(n for _, n in batch)
    wall = time.perf_counter() - t0
    in_tokens = sum(len(p) for p, _ in work)
    return {
        "wall_s": wall,
        "output_tokens": useful,
        "output_tok_s": useful / wall,
        "total_tok_s": (useful + in_tokens) / wall,
        "batch_size": batch_size,
    }


def shared_prefix_workload(n: int, prefix_len: int, vocab: int, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    return [(prefix + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 24))], 8) for _ in range(n)]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed, shared = result["mixed"], result["shared_prefix"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["kvharbor", f"HF static (batch {mixed['hf']['batch_size']})"]
    vals = [mixed["kvharbor"]["output_tok_s"], mixed["hf"]["output_tok_s"]]
    ax1.bar(names, vals, color=["tab:blue", "tab:gray"])
    ax1.set_ylabel("output tokens / s")
    ax1.set_title(f"Mixed workload ({result['config']['mixed_requests']} requests): {mixed['ratio']:.1f}x")
    labels, on, off = [], [], []
    for mode in ("concurrent", "sequential"):
        labels.append(mode)
        on.append(shared[mode]["on"]["ttft_mean_s"])
        off.append(shared[mode]["off"]["ttft_mean_s"])
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], off, width=0.4, label="prefix caching off", color="tab:gray")
    ax2.bar([i + 0.2 for i in x], on, width=0.4, label="prefix caching on", color="tab:blue")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("mean TTFT (s)")
    ax2.set_title("Shared 1,024-token prefix")
    ax2.legend()
    fig.suptitle(f"SmolLM2-135M — {machine_title(result['machine']['dtype'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small version (16 mixed, 8 shared) for a smoke run")
    ap.add_argument(
        "--hf-batch", default="16", help="HF static batch size(s), comma-separated; the ratio uses the fastest"
    )
    ap.add_argument("--dtype", default="auto", help="dtype for both engines (auto: bfloat16 on AMX CPUs)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_throughput.json")
    args = ap.parse_args()
    n_mixed, n_shared = (16, 8) if args.quick else (64, 32)

    loaded = load_model(None)
    opts = dict(
        dtype=args.dtype,
        kv_cache_memory="2GiB",
        max_model_len=2048,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    llm = LLM(loaded_model=loaded, **opts)
    dtype = llm.engine.core.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    vocab = loaded.arch.vocab_size
    print(f"SmolLM2-135M, {torch.get_num_threads()} threads, {machine_title(dtype_name)}", file=sys.stderr)

    work = mixed_workload(n_mixed, vocab)
    print(f"mixed: kvharbor, {n_mixed} requests ...", file=sys.stderr)
    ours = run_engine(llm, work)
    hf, hf_all = None, []
    if not args.skip_hf:
        model = hf_reference_model(loaded, dtype)
        for size in (int(b) for b in args.hf_batch.split(",")):
            print(f"mixed: HF static batching (batch {size}) ...", file=sys.stderr)
            hf_all.append(run_hf_static(model, work, size))
        hf = max(hf_all, key=lambda r: r["output_tok_s"])
        del model

    shared = {}
    shared_work = shared_prefix_workload(n_shared, 1024, vocab)
    for mode in ("concurrent", "sequential"):
        shared[mode] = {}
        for caching in ("on", "off"):
            print(f"shared prefix: {mode}, caching {caching} ...", file=sys.stderr)
            engine_llm = LLM(loaded_model=loaded, **opts, enable_prefix_caching=caching == "on")
            shared[mode][caching] = run_engine(engine_llm, shared_work, sequential=mode == "sequential")
            del engine_llm
        shared[mode]["ttft_ratio"] = shared[mode]["off"]["ttft_mean_s"] / shared[mode]["on"]["ttft_mean_s"]

    result = {
        "benchmark": "engine_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_record(dtype_name),
        "config": {
            "threads": torch.get_num_threads(),
            "mixed_requests": n_mixed,
            "shared_requests": n_shared,
            **{k: v for k, v in opts.items() if k != "dtype"},
        },
        "mixed": {
            "kvharbor": ours,
            "hf": hf,
            "hf_by_batch": hf_all,
            "ratio": ours["output_tok_s"] / hf["output_tok_s"] if hf else None,
        },
        "shared_prefix": shared,
    }
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if hf:
        plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def print_table(result: dict) -> None:
    m = result["mixed"]
    o = m["kvharbor"]
    hf = m["hf"] or {"output_tok_s": float("nan"), "total_tok_s": float("nan")}
    print(f"\nmixed workload                 kvharbor      HF static (best: batch {hf.get('batch_size')})")
    print(f"  output tok/s             {o['output_tok_s']:>10.1f}  {hf['output_tok_s']:>12.1f}")
    print(f"  total tok/s              {o['total_tok_s']:>10.1f}  {hf['total_tok_s']:>12.1f}")
    print(f"  TTFT p50 / p95 (s)       {o['ttft_p50_s']:>5.2f} / {o['ttft_p95_s']:<5.2f}")
    print(f"  ITL  p50 / p95 (ms)      {o['itl_p50_s'] * 1e3:>5.1f} / {o['itl_p95_s'] * 1e3:<5.1f}")
    for r in m.get("hf_by_batch", []):
        print(f"  HF batch {r['batch_size']:<3} output tok/s  {r['output_tok_s']:>10.1f}")
    if m["ratio"]:
        print(f"  throughput ratio         {m['ratio']:.2f}x vs the fastest HF batch size  (target >= 3x)")
    print("\nshared 1,024-token prefix      TTFT mean off     on    ratio (target >= 5x)")
    for mode, r in result["shared_prefix"].items():
        print(
            f"  {mode:<12}                 {r['off']['ttft_mean_s']:>8.2f}s {r['on']['ttft_mean_s']:>6.2f}s  "
            f"{r['ttft_ratio']:>6.1f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
