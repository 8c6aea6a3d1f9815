"""The quality ledger of a lossy mode: an engine configuration against the float32 reference on
the same weights, with the measures llama.cpp judges its quantizations by, and the mode's speed and
memory beside them (speed and accuracy come in pairs).

Text (nothing downloaded, nothing written by us for the purpose):
- the docstrings of these standard-library modules, as `inspect.getdoc` gives them on this
  Python: json, argparse, csv, unittest, itertools, heapq, subprocess, sqlite3, collections (the
  ones of at least 800 characters here; the first --text-tokens tokens of each, teacher-forced:
  one prefill chunk, then the last --decode-positions tokens one decode step each, so the
  one-row kernels decoding runs are measured too, and reported apart as `decode_mean_kl`);
- the chat prompts of loadtest/personas.py (each shared system prompt with each question),
  through the model's chat template, for greedy generation.

Measures, per mode against `reference` (float32, quantization none, same weights):
- mean KL(reference || mode) per token, in nats, and its 99th percentile;
- top-1 agreement: the share of positions where both predict the same next token;
- the perplexity ratio (mode / reference) on the text's own next tokens;
- greedy exact-match length: tokens generated before the first difference, on the chat prompts
  (mean, and how many of the prompts matched all GREEDY_TOKENS).
Beside them: offline decode output tok/s at batch 1 and 8 (as a ratio to the reference measured
in the same run: every engine is measured in turn, three rounds, best round kept, because this
machine's speed drifts by 20% within minutes), the linear layers' and all weights' bytes as held,
KV bytes per token, and the process's peak RSS (all modes together: benchmarks/quant_ledger.py
measures each mode's server on its own).

`gguf` runs on a GGUF file's own blocks, so its reference is the same file dequantized to float32
(what `none` serves): the two hold the same values, and its KL measures only float rounding.

`bi-off` / `bi-on` join a mode to run it with batch-invariant mode off / on (unnamed: the
engine's default, `auto`), to price what the mode costs.

The bfloat16 ledger: `bf16` runs the engine in bfloat16 (weights, activations and KV; logits are
float32 sums whatever the dtype), alone or joined to a quantized mode (`bf16+int8`, `bf16+gguf`:
their weights quantized, everything else bfloat16). `--hf-peers bf16` measures Hugging Face
transformers on the same weights in bfloat16 in the same run, against the same float32 reference,
as row `hf-bf16` (no speed columns: it is the quality peer, not a serving engine); `hf-f32` is the
check that the reference and transformers agree.

    python benchmarks/quality.py [--modes none,int8,int4,gguf,kv-int8] [--model PATH] [--text-tokens 256]
    python benchmarks/quality.py --modes bf16,bf16+int8,bf16+gguf,bf16+kv-int8 --hf-peers bf16

Prints a table, writes benchmarks/results/quality.{json,png} (speed against KL for every mode).
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import importlib
import inspect
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "loadtest"))
from personas import QUESTIONS, SYSTEM_PROMPTS

from kvharbor.common.block_hash import namespace_hash
from kvharbor.common.machine import machine_record, machine_title
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.model.loader import load_model
from kvharbor.engine.request import Request
from kvharbor.engine.scheduler import ScheduledChunk

RESULTS = Path(__file__).resolve().parent / "results"
MODULES = ("json", "argparse", "csv", "unittest", "itertools", "heapq", "subprocess", "sqlite3", "collections")
WEIGHTS = ("none", "int8", "int4", "gguf")
KV = ("kv-int8", "kv-fp8")
DTYPES = {"bf16": "bfloat16"}
INVARIANCE = {"bi-off": "off", "bi-on": "on"}  # --batch-invariant; unnamed: the engine's default (auto)
HF_PEERS = {"bf16": torch.bfloat16, "f32": torch.float32}
MODE_HELP = ("weights none|int8|int4|gguf, KV kv-int8|kv-fp8, dtype bf16 and/or batch-invariant mode "
             "bi-off|bi-on, joined by '+' (e.g. gguf+kv-int8, bf16+int8, int8+bi-off)")  # fmt: skip


def mode_options(mode: str) -> dict:
    """The engine options of a mode name: `int4`, `kv-int8`, `gguf+kv-int8`, `bf16+int8`, ...
    ValueError if unknown."""
    options: dict = {}
    for part in mode.split("+"):
        if part in WEIGHTS and "quantization" not in options:
            options["quantization"] = part
        elif part in KV and "kv_cache_dtype" not in options:
            options["kv_cache_dtype"] = part.removeprefix("kv-")
        elif part in DTYPES and "dtype" not in options:
            options["dtype"] = DTYPES[part]
        elif part in INVARIANCE and "batch_invariant" not in options:
            options["batch_invariant"] = INVARIANCE[part]
        else:
            raise ValueError(f"unknown mode {mode!r}: {MODE_HELP}")
    return options


def stdlib_texts() -> list[str]:
    return [inspect.getdoc(importlib.import_module(name)) or "" for name in MODULES]


def chat_prompts() -> list[list[dict]]:
    return [
        [{"role": "system", "content": s}, {"role": "user", "content": q}] for s in SYSTEM_PROMPTS for q in QUESTIONS
    ]


def teacher_forced_logits(llm: LLM, ids: list[int], decode_tail: int = 0) -> torch.Tensor:
    """Logits after every token of `ids` ([len(ids), vocab] float32), on a KV slot of its own:
    one prefill chunk, then the last `decode_tail` tokens one step each, as decoding runs them
    (one-row products, the decode attention kernel)."""
    engine = llm.engine
    request = Request("quality", ids, SamplingParams(max_tokens=1), 1, namespace_hash("quality-ledger"))
    if engine.core.kv.allocate_slots(request, len(ids)) is None:
        raise RuntimeError(f"the KV pool cannot hold a {len(ids)}-token text: lower --text-tokens")
    head = max(1, len(ids) - decode_tail)
    try:
        parts = [engine.core.runner.all_logits(ScheduledChunk(request, 0, head, 0))]
        parts += [engine.core.runner.all_logits(ScheduledChunk(request, i, 1, 0)) for i in range(head, len(ids))]
        return torch.cat(parts)
    finally:
        engine.core.kv.uncache_blocks([request])
        engine.core.kv.free(request)


def compare_logits(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """Per-position KL(ref || got), top-1 agreement and both NLLs of the actual next tokens."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {
        "kl": kl.tolist(),
        "top1": (ref.argmax(-1) == got.argmax(-1)).tolist(),
        "nll_ref": (-lp.gather(1, targets[:, None]).squeeze(1)).tolist(),
        "nll": (-lq.gather(1, targets[:, None]).squeeze(1)).tolist(),
    }


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode_speed(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 131 + b * 17) % 5000 + 100 for i in range(64)] for b in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t0)


def linear_bytes(llm: LLM) -> int:
    total = 0
    for layer in llm.engine.core.model.layers:
        for name, fast in layer.fast.items():
            weight = getattr(layer, name)
            total += getattr(fast, "nbytes", None) or weight.numel() * weight.element_size()
    return total


def build(options: dict, loaded) -> LLM:
    return LLM(loaded_model=loaded, **{"dtype": "float32", **options}, max_model_len=2048, num_kv_blocks=256)


@torch.inference_mode()
def measure_hf(name: str, loaded, dtype: torch.dtype, texts: list[list[int]], chats: list[list[int]], steps: int):
    """The same measures for transformers on the same weights in `dtype`: logits of one forward
    over each text, and greedy tokens through its own KV cache (EOS ignored, as for the engine)."""
    from kvharbor.engine.model.hf_reference import hf_reference_model

    model = hf_reference_model(loaded, dtype)
    # transformers 5 renamed past_key_values to cache.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = [model(torch.tensor([ids])).logits[0].float() for ids in texts]
    greedy = []
    for prompt in chats:
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_arg: getattr(out, cache_arg)})
            tokens.append(int(out.logits[0, -1].argmax()))
        greedy.append(tokens)
    return {"mode": name, "logits": logits, "greedy": greedy, "speed_tok_s": {}, "linear_weight_bytes": None,
            "kv_bytes_per_token": None, "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def measure(name: str, llm: LLM, args, texts: list[list[int]], chats: list[list[int]]) -> dict:
    logits = [teacher_forced_logits(llm, ids, args.decode_positions) for ids in texts]
    greedy = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(chats, greedy)]
    return {
        "mode": name, "logits": logits, "greedy": outputs, "speed_tok_s": {},
        "linear_weight_bytes": linear_bytes(llm), "kv_bytes_per_token": llm.engine.core.capacity.bytes_per_token,
        "weight_bytes": llm.engine.core.weight_bytes,
    }  # fmt: skip


def measure_speeds(llms: dict[str, LLM], records: dict[str, dict], tokens: int, rounds: int = 3) -> None:
    """Best output tok/s of `rounds`, every engine in turn each round (drift hits all alike)."""
    for batch in (1, 8):
        for _ in range(rounds):
            for name, llm in llms.items():
                speed = records[name]["speed_tok_s"]
                key = f"batch_{batch}"
                speed[key] = max(speed.get(key, 0.0), decode_speed(llm, batch, tokens))


def summarize(ref: dict, got: dict, texts: list[list[int]], decode_tail: int = 0) -> dict:
    pairs = zip(ref["logits"], got["logits"], texts, strict=True)
    rows = [compare_logits(r[:-1], g[:-1], torch.tensor(ids[1:])) for r, g, ids in pairs]
    kl = torch.tensor([x for row in rows for x in row["kl"]])
    # The positions computed one step each (the last decode_tail - 1 that have a next token).
    decode_kl = torch.tensor([x for row in rows for x in row["kl"][len(row["kl"]) - max(0, decode_tail - 1) :]])
    nll_ref = torch.tensor([x for row in rows for x in row["nll_ref"]])
    nll = torch.tensor([x for row in rows for x in row["nll"]])
    matches = [matched_prefix(a, b) for a, b in zip(ref["greedy"], got["greedy"], strict=True)]
    full = len(ref["greedy"][0]) if ref["greedy"] else 0
    return {
        "mode": got["mode"],
        "positions": int(kl.numel()),
        "mean_kl": float(kl.mean()),
        "p99_kl": float(kl.quantile(0.99)),
        "decode_positions": int(decode_kl.numel()),
        "decode_mean_kl": float(decode_kl.mean()) if decode_kl.numel() else None,
        "top1_agreement": float(torch.tensor([x for row in rows for x in row["top1"]], dtype=torch.float64).mean()),
        "ppl_ratio": float(torch.exp(nll.mean() - nll_ref.mean())),
        "greedy_match_mean": sum(matches) / len(matches),
        "greedy_full_matches": sum(m == full for m in matches),
        "greedy_prompts": len(matches),
        "speed_ratio": {k: got["speed_tok_s"][k] / ref["speed_tok_s"][k] for k in got["speed_tok_s"]},
        "speed_tok_s": got["speed_tok_s"],
        "linear_weight_bytes": got["linear_weight_bytes"],
        "weight_bytes": got["weight_bytes"],
        "kv_bytes_per_token": got["kv_bytes_per_token"],
    }


def table(rows: list[dict]) -> str:
    head = (f"{'mode':<14}{'mean KL':>10}{'p99 KL':>10}{'decode KL':>11}{'top-1':>8}{'PPL x':>8}{'greedy':>9}"
            f"{'tok/s b1':>10}{'x ref':>7}{'tok/s b8':>10}{'x ref':>7}{'linears MiB':>13}{'weights MiB':>13}"
            f"{'KV B/tok':>10}")  # fmt: skip
    lines = [head]
    for r in rows:
        s, x = r["speed_tok_s"], r["speed_ratio"]
        batches = ("batch_1", "batch_8")
        speed = "".join(f"{s[b]:>10.1f}{x[b]:>7.2f}" if b in s else f"{'-':>10}{'-':>7}" for b in batches)
        linears = f"{r['linear_weight_bytes'] / 2**20:>13.0f}" if r["linear_weight_bytes"] else f"{'-':>13}"
        lines.append(
            f"{r['mode']:<14}{r['mean_kl']:>10.5f}{r['p99_kl']:>10.5f}{r['decode_mean_kl'] or 0:>11.5f}"
            f"{r['top1_agreement']:>8.1%}{r['ppl_ratio']:>8.4f}{r['greedy_match_mean']:>9.1f}{speed}"
            f"{linears}{r['weight_bytes'] / 2**20:>13.0f}{r['kv_bytes_per_token'] or '-':>10}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        for batch, marker in (("batch_1", "o"), ("batch_8", "s")):
            if batch not in r["speed_ratio"]:  # a quality peer (hf-*): KL only, drawn at speed 0
                ax.scatter(max(r["mean_kl"], 1e-9), 0.0, marker="x")
                ax.annotate(r["mode"], (max(r["mean_kl"], 1e-9), 0.0))
                break
            ax.scatter(max(r["mean_kl"], 1e-9), r["speed_ratio"][batch], marker=marker)
            ax.annotate(f"{r['mode']} {batch.replace('_', ' ')}", (max(r["mean_kl"], 1e-9), r["speed_ratio"][batch]))
    ax.set_xscale("log")
    ax.set_xlabel("mean KL per token vs float32 (nats, log)")
    ax.set_ylabel("decode tok/s / reference")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,int8,int4,gguf,kv-int8", help=f"comma-separated; each {MODE_HELP}")
    parser.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    parser.add_argument("--text-tokens", type=int, default=256, help="tokens of each docstring, teacher-forced")
    parser.add_argument("--decode-positions", type=int, default=32,
                        help="of those, the last ones run one step each, as decoding runs them")  # fmt: skip
    parser.add_argument("--greedy-tokens", type=int, default=48, help="tokens generated per chat prompt")
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens per sequence for the speed columns")
    parser.add_argument("--hf-peers", default="", help=f"comma-separated: {', '.join(HF_PEERS)} (transformers "
                        "in that dtype, same weights, quality only)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    args = parser.parse_args(argv)
    peers = [p.strip() for p in args.hf_peers.split(",") if p.strip()]
    if set(peers) - set(HF_PEERS):
        parser.error(f"--hf-peers takes {', '.join(HF_PEERS)}, got {args.hf_peers!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        parser.error(f"no mode given: {MODE_HELP}")
    try:
        options = {m: mode_options(m) for m in modes}
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.text_tokens, args.greedy_tokens, args.speed_tokens) < 2:
        parser.error("--text-tokens, --greedy-tokens and --speed-tokens must be >= 2")
    if not 0 <= args.decode_positions < args.text_tokens:
        parser.error("--decode-positions must be >= 0 and below --text-tokens")
    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        parser.error(f"{args.model} has no tokenizer: the quality ledger needs text")
    texts = [loaded.tokenizer.encode(t)[: args.text_tokens] for t in stdlib_texts()]
    texts = [ids for ids in texts if len(ids) >= 2]
    chats = [loaded.tokenizer.encode_chat(m) for m in chat_prompts()]
    # gguf runs on the file's own blocks; the reference is the same file dequantized to float32.
    gguf = [m for m in modes if options[m].get("quantization") == "gguf"]
    blocks = load_model(args.model, keep_blocks=True) if gguf else None
    llms = {"reference": build({}, loaded)}
    llms |= {m: build(options[m], blocks if m in gguf else loaded) for m in modes}
    records = {name: measure(name, llm, args, texts, chats) for name, llm in llms.items()}
    measure_speeds(llms, records, args.speed_tokens)
    records |= {f"hf-{p}": measure_hf(f"hf-{p}", loaded, HF_PEERS[p], texts, chats, args.greedy_tokens) for p in peers}
    ref = records["reference"]
    rows = [summarize(ref, records[m], texts, args.decode_positions) for m in [*modes, *(f"hf-{p}" for p in peers)]]
    machine = machine_record("float32")
    print(f"quality ledger of {loaded.name} against float32, {machine_title('float32')}")
    print(f"{sum(len(t) - 1 for t in texts)} teacher-forced positions from {len(texts)} stdlib docstrings; "
          f"{len(chats)} chat prompts x {args.greedy_tokens} greedy tokens")  # fmt: skip
    print(table(rows))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS of this process (all modes): {peak_rss / 2**20:.0f} MiB")
    record = {"benchmark": "quality", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
              "model": loaded.name, "text": {"modules": MODULES, "tokens_each": args.text_tokens},
              "chat_prompts": len(chats), "reference_speed_tok_s": ref["speed_tok_s"], "rows": rows,
              "modes": {m: mode_options(m) for m in modes}, "hf_peers": peers, "peak_rss_bytes": peak_rss}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    plot(rows, args.out.with_suffix(".png"), f"speed vs KL, {loaded.name} — {machine_title('float32')}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
