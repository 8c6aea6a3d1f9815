"""Serving benchmark against any OpenAI-compatible server on this machine (kvharbor, vLLM, ...).

Prompts are token ids (exact lengths, no tokenizer needed): random ids, optionally behind a shared
prefix. Requests stream from /v1/completions with ignore_eos, so every request asks for the same
work on every server. Load is fixed concurrency or Poisson arrivals. Reports TTFT, ITL and
end-to-end latency at p50/p95/p99, throughput, and goodput under SLOs; writes JSON.

Bounded: --num-requests per run and --timeout overall; it talks to loopback addresses only.

    python benchmarks/serve.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --concurrency 1,8 --shared-prefix 0,100 --num-requests 32 --prompt-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from kvharbor.common.machine import machine_record

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = float("nan")
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = float("nan")
    error: str = ""


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"refusing {url}: this benchmark only talks to loopback addresses")


def make_prompts(n: int, prompt_len: int, shared_prefix: int, vocab: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(*vocab) for _ in range(min(shared_prefix, prompt_len))]
    return [prefix + [rng.randrange(*vocab) for _ in range(prompt_len - len(prefix))] for _ in range(n)]


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    temperature: float,
    extra: dict | None = None,
) -> RequestResult:
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(
    url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    concurrency: int | None,
    rate: float | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=max(concurrency or 0, 64))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if concurrency:
            gate = asyncio.Semaphore(concurrency)

            async def gated(p: list[int]) -> RequestResult:
                async with gate:
                    return await one_request(client, url, model, p, output_len, temperature)

            results = await asyncio.gather(*(gated(p) for p in prompts))
        else:
            rng = random.Random(seed)
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(one_request(client, url, model, p, output_len, temperature)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [x for r in ok for x in r.itls_s]
    e2e = [r.e2e_s for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft_s <= slo_ttft and (statistics.fmean(r.itls_s) if r.itls_s else 0) <= slo_itl]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        "requests_per_s": len(ok) / wall,
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 95, 99)},
        "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
        **{f"itl_p{q}_s": pct(itl, q) for q in (50, 95, 99)},
        **{f"e2e_p{q}_s": pct(e2e, q) for q in (50, 95, 99)},
        "goodput_requests_per_s": len(good) / wall,
        "slo_attainment": len(good) / len(results) if results else float("nan"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server base URL (loopback only), e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="model id the server expects")
    ap.add_argument("--label", default="server", help="name of this server in the results")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", default="8", help="comma-separated concurrency levels (or 0 with --request-rate)")
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--shared-prefix", default="0", help="comma-separated shared-prefix lengths in tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--vocab-range", default="1000,20000", help="token ids are drawn from this range")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=200.0)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before each run")
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype", default=None, help="the dtype the server runs in, only recorded (default: unknown, recorded as null)"
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: benchmarks/results/serve-LABEL.json)")
    args = ap.parse_args(argv)
    check_loopback(args.url)
    return args


async def bench(args: argparse.Namespace) -> dict:
    lo, hi = (int(x) for x in args.vocab_range.split(","))
    runs = []
    levels = [int(c) for c in args.concurrency.split(",")] if args.request_rate is None else [0]
    for shared in (int(s) for s in args.shared_prefix.split(",")):
        for concurrency in levels:
            prompts = make_prompts(args.num_requests, args.prompt_len, shared, (lo, hi), args.seed + shared)
            warm = make_prompts(args.warmup, args.prompt_len, 0, (lo, hi), args.seed + 10_000)
            if warm:
                await run_load(args.url, args.model, warm, 4, args.temperature, len(warm), None, args.seed)
            results, wall = await run_load(
                args.url,
                args.model,
                prompts,
                args.output_len,
                args.temperature,
                concurrency or None,
                args.request_rate,
                args.seed,
            )
            summary = summarize(results, wall, args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
            runs.append(
                {
                    "shared_prefix": shared,
                    "concurrency": concurrency,
                    "request_rate": args.request_rate,
                    "summary": summary,
                    "requests": [asdict(r) for r in results],
                }
            )
            print_run(args.label, runs[-1])
    return {
        "benchmark": "serve",
        "label": args.label,
        "url": args.url,
        "model": args.model,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        # The server runs on this machine (loopback only); its dtype is null when the caller did not say.
        "machine": machine_record(args.dtype) | {"dtype": args.dtype},
        "runs": runs,
    }


def print_run(label: str, run: dict) -> None:
    s = run["summary"]
    load = f"c={run['concurrency']}" if run["concurrency"] else f"rate={run['request_rate']}/s"
    print(
        f"{label:<10} prefix={run['shared_prefix']:<4} {load:<8} out tok/s {s['output_tok_s']:7.1f}  "
        f"TTFT p50/p95 {s['ttft_p50_s'] * 1e3:7.0f}/{s['ttft_p95_s'] * 1e3:<7.0f} ms  "
        f"ITL mean {s['itl_mean_s'] * 1e3:6.1f} ms  E2E p50 {s['e2e_p50_s']:6.2f} s  "
        f"goodput {s['goodput_requests_per_s']:5.2f} req/s  errors {s['errors']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = asyncio.run(asyncio.wait_for(bench(args), timeout=args.timeout))
    except TimeoutError:
        print(f"benchmark did not finish within --timeout {args.timeout}s", file=sys.stderr)
        return 1
    out = args.out or RESULTS / f"serve-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 1 if any(r["summary"]["errors"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
