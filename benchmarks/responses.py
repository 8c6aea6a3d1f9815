"""The Responses API: turn 2 of a stored conversation against the same history sent cold, and
the gateway's added latency for a Responses call against a chat call.

    python benchmarks/responses.py     # writes benchmarks/results/responses.{json,png}

Two `kvharbor serve` engines (SmolLM2, `auto` dtype), a real redis-server, `kvharbor kvcache`
(the KV index prefix routing reads) and one gateway with prefix routing run on this machine.
Each conversation's turn 1 is a document and a question (`--doc-len` tokens), streamed through
`POST /v1/responses`; turn 2 is a follow-up, sent three ways, each timed to its first token:

    stored     previous_response_id: the gateway rebuilds the history from Redis
    chat_warm  the same history as a chat completion, by the same tenant (what a stateless client
               sends): the same prompt, the same cached prefix
    chat_cold  the same history as a chat completion by another tenant: its cache salt shares no
               blocks, so the whole prompt is computed (the cost turn 2 would pay without the
               prefix cache where turn 1 ran)

The overhead part pairs a unary Responses call (stored, 1 output token) with the same chat call
and reports the difference (p50, p99): translation, the Redis read and write, the re-encoding.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import MODEL, free_port, server
from serve import pct

from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title
from kvharbor.gateway.tenants import hash_key
from kvharbor.launch.embedded_redis import EmbeddedRedis

RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "kvharbor.launch.cli"]
WORDS = ("harbor", "ship", "crane", "dock", "cargo", "tide", "pier", "berth", "anchor", "rope", "sail", "hull", "deck",
         "mast", "keel", "port", "storm", "wind", "light", "bell", "chart", "route", "quay", "lock", "gate", "river",
         "canal", "bridge", "tower", "market", "ledger")  # fmt: skip
MODES = ("stored", "chat_warm", "chat_cold")
ORDERS = list(itertools.permutations(MODES))


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def first_token(http: httpx.AsyncClient, url: str, body: dict, key: str, responses: bool) -> tuple[float, dict]:
    """Seconds to the first text of a streamed call, and the final usage (and id, for Responses)."""
    path = "/v1/responses" if responses else "/v1/chat/completions"
    t0, ttft, final = time.perf_counter(), None, {}
    async with http.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if responses:
                text = event.get("delta") if event.get("type") == "response.output_text.delta" else None
            else:
                text = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            if responses and event.get("type") in ("response.completed", "response.incomplete"):
                final = {"id": event["response"]["id"], "usage": event["response"]["usage"],
                         "output": event["response"]["output"]}  # fmt: skip
            if not responses and event.get("usage"):
                final = {"usage": event["usage"]}
    return (ttft if ttft is not None else float("nan")), final


def cached_of(usage: dict) -> int:
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


async def conversations(url: str, n: int, doc_words: int, output: int) -> dict[str, list[dict]]:
    rng = random.Random(0)
    out: dict[str, list[dict]] = {m: [] for m in MODES}
    async with httpx.AsyncClient(timeout=300) as http:
        for i in range(n):
            question = f"Document {i}: {document(rng, doc_words)}\n\nWhich word comes up most often?"
            turn1 = {"model": MODEL, "input": question, "stream": True, "max_output_tokens": output, "temperature": 0}
            _, first = await first_token(http, url, turn1, "sk-acme", True)
            answer = "".join(p["text"] for item in first["output"] if item["type"] == "message"
                             for p in item["content"])  # fmt: skip
            follow = "Now name a word that never comes up."
            stored = {"model": MODEL, "input": follow, "previous_response_id": first["id"], "stream": True,
                      "max_output_tokens": output, "temperature": 0}  # fmt: skip
            history = [{"role": "user", "content": question}, {"role": "assistant", "content": answer},
                       {"role": "user", "content": follow}]  # fmt: skip
            chat = {"model": MODEL, "messages": history, "stream": True, "max_tokens": output, "temperature": 0,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            # Each order in turn: the first same-tenant call after turn 1 computes the assistant turn's
            # and the follow-up's blocks, and the next one finds them cached; no mode is first more often.
            order = ORDERS[i % len(ORDERS)]
            for mode in order:
                body, key, responses = {"stored": (stored, "sk-acme", True), "chat_warm": (chat, "sk-acme", False),
                                        "chat_cold": (chat, "sk-cold", False)}[mode]  # fmt: skip
                ttft, final = await first_token(http, url, body, key, responses)
                usage = final.get("usage") or {}
                prompt = usage.get("input_tokens", usage.get("prompt_tokens", 0))
                out[mode].append({"ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached_of(usage),
                                  "place": order.index(mode)})  # fmt: skip
    return out


async def overhead(url: str, n: int) -> dict:
    """Paired unary calls: a stored Responses call against the same chat call."""
    head = {"Authorization": "Bearer sk-overhead"}
    resp_body = {"model": MODEL, "input": "The capital of France is", "max_output_tokens": 1, "temperature": 0}
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "The capital of France is"}],
                 "max_tokens": 1, "temperature": 0}  # fmt: skip
    chat, resp = [], []
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(n + 5):
            for path, body, out in (("/v1/chat/completions", chat_body, chat), ("/v1/responses", resp_body, resp)):
                t0 = time.perf_counter()
                (await http.post(url + path, json=body, headers=head)).raise_for_status()
                if i >= 5:
                    out.append(time.perf_counter() - t0)
    added = [r - c for c, r in zip(chat, resp, strict=True)]
    return {"requests": n, "chat_p50_ms": pct(chat, 50) * 1000, "responses_p50_ms": pct(resp, 50) * 1000,
            "added_p50_ms": pct(added, 50) * 1000, "added_p99_ms": pct(added, 99) * 1000}  # fmt: skip


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for mode, rows in runs.items():
        ttfts = [r["ttft_s"] for r in rows]
        prompt = sum(r["prompt_tokens"] for r in rows)
        out[mode] = {"ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p90_ms": pct(ttfts, 90) * 1000,
                     "prompt_tokens_mean": prompt / len(rows),
                     "cached_share": sum(r["cached_tokens"] for r in rows) / max(1, prompt)}  # fmt: skip
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = result["turn2"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(MODES, [turns[m]["ttft_p50_ms"] for m in MODES], color=["tab:green", "tab:blue", "tab:gray"])
    axes[0].set_title("turn 2 TTFT p50 (ms)")
    axes[1].bar(MODES, [turns[m]["cached_share"] * 100 for m in MODES], color=["tab:green", "tab:blue", "tab:gray"])
    axes[1].set_title("turn 2 prompt served from the prefix cache (%)")
    o = result["overhead"]
    axes[2].bar(["added p50", "added p99"], [o["added_p50_ms"], o["added_p99_ms"]], color="tab:orange")
    axes[2].set_title("Responses over chat, unary (ms)")
    cfg = result["config"]
    fig.suptitle(f"{MODEL}, 2 engines, prefix routing: {cfg['conversations']} two-turn conversations of "
                 f"~{cfg['doc_words']}-word documents\n{machine_title(result['machine']['dtype'])}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    print(f"\n{'turn 2':<12}{'TTFT p50':>10}{'TTFT p90':>10}{'prompt':>9}{'cached':>9}")
    for mode, s in result["turn2"].items():
        print(f"{mode:<12}{s['ttft_p50_ms']:>10.0f}{s['ttft_p90_ms']:>10.0f}{s['prompt_tokens_mean']:>9.0f}"
              f"{s['cached_share']:>9.0%}")  # fmt: skip
    t = result["turn2"]
    print(f"\nstored turn 2 is {t['chat_cold']['ttft_p50_ms'] / t['stored']['ttft_p50_ms']:.2f}x faster to its first "
          f"token than the cold history (p50), and {t['stored']['ttft_p50_ms'] / t['chat_warm']['ttft_p50_ms']:.2f}x "
          "the warm chat's")  # fmt: skip
    o = result["overhead"]
    print(f"Responses over chat, unary, {o['requests']} pairs: chat p50 {o['chat_p50_ms']:.1f} ms, responses p50 "
          f"{o['responses_p50_ms']:.1f} ms; added p50 {o['added_p50_ms']:.2f} ms, p99 {o['added_p99_ms']:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=30, help="two-turn conversations (6 orders of the 3 modes)")
    ap.add_argument("--doc-words", type=int, default=400, help="words of each conversation's document")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per turn")
    ap.add_argument("--overhead-requests", type=int, default=100, help="paired unary calls for the overhead")
    ap.add_argument("--out", type=Path, default=RESULTS / "responses.json", help="JSON output (PNG beside it)")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / "logs"
    logs.mkdir(exist_ok=True)
    result: dict = {"benchmark": "responses", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "config": vars(args) | {"out": str(args.out)},
                    "machine": machine_record(auto_cpu_dtype())}  # fmt: skip
    with EmbeddedRedis() as rds, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tenants = Path(tmp) / "tenants.yaml"
        names = ("acme", "cold", "overhead")
        tenants.write_text(yaml.safe_dump({"tenants": [{"name": n, "api_keys": [hash_key("sk-" + n)]} for n in names]}))
        engines = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        print("starting two engines, the KV cache service and a gateway ...", flush=True)
        for i, url in enumerate(engines):
            cmd = [*CLI, "serve", "--port", url.rsplit(":", 1)[1], "--instance-id", f"engine-{i}", "--redis-url",
                   rds.url, "--kv-cache-memory", "512MiB", "--max-model-len", "4096"]  # fmt: skip
            stack.enter_context(server(cmd, url, "/ready", logs / f"resp-engine-{i}.log", {}, 300))
        svc = f"http://127.0.0.1:{free_port()}"
        stack.enter_context(server([*CLI, "kvcache", "--redis-url", rds.url, "--port", svc.rsplit(":", 1)[1]], svc,
                                   "/ready", logs / "resp-kvcache.log", {}, 60))  # fmt: skip
        gateway = f"http://127.0.0.1:{free_port()}"
        cmd = [*CLI, "gateway", "--port", gateway.rsplit(":", 1)[1], "--admin-port", str(free_port()), "--engines",
               ",".join(engines), "--tenants-file", str(tenants), "--redis-url", rds.url, "--routing", "prefix",
               "--slo-ttft-ms", "60000"]  # fmt: skip
        stack.enter_context(server(cmd, gateway, "/ready", logs / "resp-gateway.log", {}, 120))
        print(f"turn 2 of {args.conversations} conversations, three ways ...", flush=True)
        runs = asyncio.run(conversations(gateway, args.conversations, args.doc_words, args.output_len))
        result["turn2"] = summarize(runs)
        result["runs"] = runs
        print(f"overhead: {args.overhead_requests} paired unary calls ...", flush=True)
        result["overhead"] = asyncio.run(overhead(gateway, args.overhead_requests))
    t = result["turn2"]
    result["stored_vs_cold_ttft_p50"] = t["chat_cold"]["ttft_p50_ms"] / t["stored"]["ttft_p50_ms"]
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
