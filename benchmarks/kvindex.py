"""KV index and shared block store: lookup latency, event intake rate, and TTFT when engine B pulls a
1,024-token prefix that engine A computed, against B recomputing it.

    python benchmarks/kvindex.py            # writes benchmarks/results/kvindex.{json,png}

Everything runs on this machine against a real redis-server (EmbeddedRedis) and, for the TTFT part,
two real `kvharbor serve` processes with SmolLM2. Each figure is compared with a baseline measured
in the same run: Redis lookups against in-memory ones, pulled TTFT against recomputed TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as serve_bench
from compare_peers import MODEL, free_port, server

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.kv_events import BlockStored, EventEnvelope, to_fields
from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title
from kvharbor.common.redis_keys import lease_key, registry_value, stream_key, stream_registry_key
from kvharbor.kvcache_service.consumer import EventConsumer
from kvharbor.kvcache_service.memory_index import MemoryIndex
from kvharbor.kvcache_service.redis_index import RedisIndex
from kvharbor.launch.embedded_redis import EmbeddedRedis

RESULTS = Path(__file__).resolve().parent / "results"
BENCH_MODEL = "bench-model"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- lookups --------------------------------------------------------------------------------------


async def fill(index, chain: list[bytes], instances: int) -> None:
    """Instance i holds the first (i+1)/n of the chain: the longest holder has all of it."""
    for i in range(instances):
        inst = f"engine-{i}"
        held = chain[: len(chain) * (i + 1) // instances]
        await index.renew(BENCH_MODEL, inst, "lease", 600)
        events = [
            EventEnvelope(BlockStored(tuple(held[k : k + 256]), None, 16), inst, BENCH_MODEL, "lease", k)
            for k in range(0, len(held), 256)
        ]
        await index.apply(events)


async def time_lookups(index, chain: list[bytes], reps: int) -> dict:
    expected = {f"engine-{i}": len(chain) * (i + 1) // 8 for i in range(8)}
    assert await index.lookup(BENCH_MODEL, chain) == expected, "lookup answered wrongly"
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await index.lookup(BENCH_MODEL, chain)
        times.append(time.perf_counter() - t0)
    return {"p50_ms": pct(times, 50) * 1000, "p99_ms": pct(times, 99) * 1000, "reps": reps}


async def bench_lookups(redis_url: str, blocks: int, reps: int) -> dict:
    import redis.asyncio as aredis

    chain = block_hashes(list(range(blocks * 16)), 16, BENCH_MODEL)
    memory = MemoryIndex()
    await fill(memory, chain, 8)
    client = aredis.from_url(redis_url)
    await client.flushdb()
    rindex = RedisIndex(client)
    await fill(rindex, chain, 8)
    out = {"memory": await time_lookups(memory, chain, reps), "redis": await time_lookups(rindex, chain, reps)}
    await rindex.close()
    return out


# -- intake ---------------------------------------------------------------------------------------


async def bench_intake(redis_url: str, events: int) -> dict:
    import redis
    import redis.asyncio as aredis

    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()
    rng = random.Random(0)
    chains = [block_hashes(list(range(i * 100_000, i * 100_000 + 64 * 16)), 16, BENCH_MODEL) for i in range(32)]
    envelopes = []
    for seq in range(events):
        chain = rng.choice(chains)
        start = rng.randrange(0, 56)
        event = BlockStored(tuple(chain[start : start + 8]), chain[start - 1] if start else None, 16)
        envelopes.append(EventEnvelope(event, f"engine-{seq % 8}", BENCH_MODEL, "lease", seq))
    for i in range(8):
        sync.set(lease_key(BENCH_MODEL, f"engine-{i}"), "lease", px=600_000)
        inst = f"engine-{i}"
        sync.hset(stream_registry_key(), stream_key(BENCH_MODEL, inst), registry_value(BENCH_MODEL, inst))
    pipe = sync.pipeline(transaction=False)
    for env in envelopes:
        pipe.xadd(stream_key(BENCH_MODEL, env.instance), to_fields(env))
    pipe.execute()

    memory = MemoryIndex()
    t0 = time.perf_counter()
    await memory.apply(envelopes)
    memory_s = time.perf_counter() - t0

    client = aredis.from_url(redis_url)
    index = RedisIndex(aredis.from_url(redis_url))
    consumer = EventConsumer(client, index, poll_ms=10)
    t0 = time.perf_counter()
    while consumer.stats.applied < events and time.perf_counter() - t0 < 300:
        await consumer.step()
    redis_s = time.perf_counter() - t0
    assert consumer.stats.applied == events, f"applied {consumer.stats.applied} of {events}"
    await consumer.stop()
    await client.aclose()
    await index.close()
    return {
        "events": events,
        "hashes_per_event": 8,
        "redis_consumer_events_per_s": events / redis_s,
        "memory_apply_events_per_s": events / memory_s,
    }


# -- TTFT: pulled from the store vs recomputed -----------------------------------------------------


async def ttft(url: str, prompt: list[int], extra: dict) -> float:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        result = await serve_bench.one_request(client, url, MODEL, prompt, 1, 0.0, extra)
    if not result.ok:
        raise RuntimeError(f"request failed: {result.error}")
    return result.ttft_s


def pushed_blocks(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvharbor_kv_store_pushed_blocks_total"):
            return float(line.split()[-1])
    return 0.0


def bench_ttft(redis_url: str, reps: int, prefix_len: int, logs: Path) -> dict:
    common = ["--redis-url", redis_url, "--kv-cache-memory", "256MiB", "--max-num-batched-tokens", "512"]
    a_url, b_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvharbor.launch.cli", "serve"]
    a_cmd = [*cmd, "--port", a_url.rsplit(":", 1)[1], "--instance-id", "A", "--kv-store-push", "all", *common]
    b_cmd = [*cmd, "--port", b_url.rsplit(":", 1)[1], "--instance-id", "B", *common]
    pulled, recomputed = [], []
    with (
        server(a_cmd, a_url, "/ready", logs / "kvindex-A.log", {}, 300),
        server(b_cmd, b_url, "/ready", logs / "kvindex-B.log", {}, 300),
    ):
        rng = random.Random(1)
        for rep in range(reps + 1):  # the first round warms both paths up and is not counted
            prefix = [rng.randrange(1000, 40000) for _ in range(prefix_len)]
            question = [rng.randrange(1000, 40000) for _ in range(12)]
            before = pushed_blocks(a_url)
            asyncio.run(ttft(a_url, [*prefix, 7], {}))
            deadline = time.monotonic() + 60
            while pushed_blocks(a_url) < before + prefix_len // 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            shared = asyncio.run(ttft(b_url, [*prefix, *question], {"kv_prefix_source": "shared"}))
            scratch = asyncio.run(ttft(b_url, [*prefix, *question], {"cache_salt": f"scratch-{rep}"}))
            if rep:
                pulled.append(shared)
                recomputed.append(scratch)
            print(f"  round {rep}: pulled {shared * 1000:.0f} ms, recomputed {scratch * 1000:.0f} ms", flush=True)
    return {
        "prefix_tokens": prefix_len,
        "reps": reps,
        "pulled_ttft_ms": [t * 1000 for t in pulled],
        "recomputed_ttft_ms": [t * 1000 for t in recomputed],
        "pulled_median_ms": statistics.median(pulled) * 1000,
        "recomputed_median_ms": statistics.median(recomputed) * 1000,
        "speedup": statistics.median(recomputed) / statistics.median(pulled),
    }


# -- report ---------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if "ttft" in result else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    lk = result["lookup"]
    for i, q in enumerate(("p50_ms", "p99_ms")):
        axes[0].bar([x + i * 0.4 for x in range(2)], [lk["memory"][q], lk["redis"][q]], width=0.4, label=q)
    axes[0].set_xticks([0.2, 1.2], ["in memory", "Redis (Lua)"])
    axes[0].set_title(f"lookup, {result['config']['blocks']}-block chain, 8 instances (ms)")
    axes[0].legend(loc="upper left")
    ing = result["intake"]
    axes[1].bar(["in memory", "Redis consumer"], [ing["memory_apply_events_per_s"], ing["redis_consumer_events_per_s"]])
    axes[1].set_title("event intake (events / s)")
    if "ttft" in result:
        t = result["ttft"]
        axes[2].bar(["recomputed", "pulled from store"], [t["recomputed_median_ms"], t["pulled_median_ms"]])
        axes[2].set_title(f"engine B TTFT, {t['prefix_tokens']}-token prefix (ms, median)")
    fig.suptitle(f"KV index and shared block store — {machine_title(result['machine'].get('dtype'))}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    lk, ing = result["lookup"], result["intake"]
    rows = [
        ("lookup p50 ms (Redis / in memory)", lk["redis"]["p50_ms"], lk["memory"]["p50_ms"], "{:.2f}"),
        ("lookup p99 ms (Redis / in memory)", lk["redis"]["p99_ms"], lk["memory"]["p99_ms"], "{:.2f}"),
        (
            "intake events/s (Redis consumer / memory)",
            ing["redis_consumer_events_per_s"],
            ing["memory_apply_events_per_s"],
            "{:.0f}",
        ),
    ]
    if "ttft" in result:
        t = result["ttft"]
        rows.append(("TTFT ms on B (pulled / recomputed)", t["pulled_median_ms"], t["recomputed_median_ms"], "{:.0f}"))
    print(f"\n{'measure':<44}{'value':>12}{'baseline':>12}{'ratio':>8}")
    for name, value, base, fmt in rows:
        print(f"{name:<44}{fmt.format(value):>12}{fmt.format(base):>12}{value / base:>8.2f}")
    if "ttft" in result:
        print(f"\npulling is {result['ttft']['speedup']:.1f}x faster than recomputing (target: >= 3x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2048, help="chain length for lookups")
    ap.add_argument("--lookups", type=int, default=300, help="lookups timed per backend")
    ap.add_argument("--events", type=int, default=20000, help="events for the intake rate")
    ap.add_argument("--ttft-reps", type=int, default=5, help="TTFT rounds (0 skips the engines)")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens for TTFT")
    ap.add_argument("--out", type=Path, default=RESULTS / "kvindex.json", help="JSON output (PNG beside it)")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / "logs"
    logs.mkdir(exist_ok=True)
    result: dict = {
        "benchmark": "kvindex",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(args) | {"out": str(args.out)},
        # Only the TTFT part runs engines (`kvharbor serve`'s default dtype); without it no dtype applies.
        "machine": machine_record(auto_cpu_dtype() if args.ttft_reps else None),
    }
    with EmbeddedRedis() as redis_server:
        print(f"lookups: {args.blocks}-block chain, 8 instances, {args.lookups} each ...", flush=True)
        result["lookup"] = asyncio.run(bench_lookups(redis_server.url, args.blocks, args.lookups))
        print(f"intake: {args.events} events ...", flush=True)
        result["intake"] = asyncio.run(bench_intake(redis_server.url, args.events))
        if args.ttft_reps:
            print(f"TTFT: two engines, {args.ttft_reps} rounds of a {args.prefix_len}-token prefix ...", flush=True)
            result["ttft"] = bench_ttft(redis_server.url, args.ttft_reps, args.prefix_len, logs)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
