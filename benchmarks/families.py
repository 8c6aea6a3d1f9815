"""Decode speed of every model family kvharbor runs, against transformers on the same weights in
the same run, and the Gemma 3 GGUF served as shipped against llama.cpp's llama-server.

Models: the bundled SmolLM2-135M (llama) and Gemma 3 270M (gemma3_text: dequantized to float32,
and its blocks kept under --quantization gguf); qwen3, phi3, mistral and gemma2 as random-weight
models of SmolLM2's size (576 wide, 30 layers, 9 heads over 3 KV heads, 49,152 tokens), each with
its family's features: q/k norms (qwen3), fused projections (phi3), a sliding window of WINDOW
tokens, shorter than prompt + output so the banded path runs (phi3, mistral, gemma2), soft-caps
(gemma2). Random weights decode as fast as trained ones: the work per token is the same.

Offline, in this process, float32, greedy with ignore_eos: concurrency 1 is --requests prompts
one after another, concurrency 8 is 8 prompts at once; transformers' generate takes the same
prompts in batches of 1 and 8 (left-padded). Output tok/s counts only the tokens asked for.
With --llama-server BIN, `kvharbor serve --quantization gguf` and llama-server on the same Gemma
file are also measured served (benchmarks/serve.py's workload, at concurrency 1 and 8).

    python benchmarks/families.py [--families llama,qwen3,...] [--llama-server /path/to/llama-server]

Prints a table, writes benchmarks/results/families.{json,png}.
"""

from __future__ import annotations

import kvharbor.engine  # noqa: F401  first: OpenMP's wait policy is read when torch loads (engine/__init__.py)

# isort: split
import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peers
import engine_throughput
import serve as serve_bench

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.common.model_files import GEMMA3_270M, chunked_model_path
from kvharbor.engine import LLM
from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.model.loader import LoadedModel, load_model
from kvharbor.launch.embedded_redis import free_port

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW = 128
SMOL_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
RANDOM_FAMILIES = {
    "qwen3": {},
    "phi3": {"sliding_window": WINDOW, "tie_word_embeddings": False},  # Phi-3 has its own head
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}
FAMILIES = ("llama", *RANDOM_FAMILIES, "gemma3", "gemma3-gguf")
LEVELS = (1, 8)


def random_model(family: str, folder: Path) -> tuple[LoadedModel, torch.nn.Module]:
    """A random-weight transformers model of the family at SmolLM2's size, saved and loaded back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SMOL_SHAPE, **RANDOM_FAMILIES[family]})
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(folder / family)
    return load_model(str(folder / family), served_name=family), hf


def gemma3_reference(path: Path, loaded: LoadedModel) -> torch.nn.Module:
    """transformers' Gemma 3 (its config read from the GGUF itself) with the dequantized weights."""
    from transformers import AutoConfig, Gemma3ForCausalLM

    model = Gemma3ForCausalLM(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)).float().eval()
    model.load_state_dict(loaded.state_dict, strict=False)
    model.tie_weights()
    return model


def models(family: str, scratch: Path) -> tuple[LoadedModel, str, torch.nn.Module]:
    """(kvharbor's model, its --quantization, the transformers baseline on the same weights)."""
    if family == "llama":
        loaded = load_model(None)
        return loaded, "none", hf_reference_model(loaded)
    if family in RANDOM_FAMILIES:
        loaded, hf = random_model(family, scratch)
        return loaded, "none", hf
    path = chunked_model_path(GEMMA3_270M)
    dense = load_model(str(path), served_name="gemma-3-270m")
    reference = gemma3_reference(path, dense)
    if family == "gemma3":
        return dense, "none", reference
    return load_model(str(path), keep_blocks=True, served_name="gemma-3-270m"), "gguf", reference


def workload(n: int, args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(n)
    return [
        ([rng.randrange(1000, min(vocab, 20000)) for _ in range(args.prompt_len)], args.output_len) for _ in range(n)
    ]


def measure_family(family: str, args: argparse.Namespace, scratch: Path) -> dict:
    """kvharbor and transformers at each concurrency, on one family's weights."""
    loaded, quantization, hf = models(family, scratch)
    llm = LLM(
        loaded_model=loaded,
        dtype="float32",
        quantization=quantization,
        max_model_len=1024,
        num_kv_blocks=8 * (args.prompt_len + args.output_len) // 16 + 16,
    )
    row = {
        "family": family,
        "architecture": loaded.arch.architecture,
        "quantization": quantization,
        "weight_bytes": llm.engine.core.load().weight_bytes,
    }
    vocab = loaded.arch.vocab_size
    warm = [(p, 8) for p, _ in workload(1, args, vocab)]  # both sides: kernels, first allocations
    engine_throughput.run_engine(llm, warm)
    engine_throughput.run_hf_static(hf, warm, batch_size=1)
    for c in LEVELS:
        work = workload(args.requests if c == 1 else c, args, vocab)
        ours = engine_throughput.run_engine(llm, work, sequential=c == 1)
        theirs = engine_throughput.run_hf_static(hf, work, batch_size=c)
        row[f"c{c}"] = {
            "kvharbor_tok_s": ours["output_tok_s"],
            "transformers_tok_s": theirs["output_tok_s"],
            "ratio": ours["output_tok_s"] / theirs["output_tok_s"],
            "itl_p50_s": ours["itl_p50_s"],
        }
        print(f"  {family} c={c}: {ours['output_tok_s']:.1f} vs {theirs['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return row


def served_gemma(args: argparse.Namespace, logs: Path) -> dict[str, dict]:
    """kvharbor serve --quantization gguf and llama-server on the same Gemma 3 file, served."""
    path = chunked_model_path(GEMMA3_270M)
    slots = max(LEVELS)
    out = {}
    for label in ("kvharbor gguf", "llama-server"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if label == "llama-server":
            cmd = [args.llama_server, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb",
                   "2", "-np", str(slots), "-c", str(1024 * slots), "--alias", "gemma-3-270m", "-ngl", "0"]  # fmt: skip
            ready = "/health"
        else:
            cmd = [sys.executable, "-m", "kvharbor.launch.cli", "serve", "--port", str(port), "--log-level", "warning",
                   "--model", str(path), "--served-model-name", "gemma-3-270m", "--dtype", "float32",
                   "--quantization", "gguf", "--max-model-len", "1024"]  # fmt: skip
            ready = "/ready"
        print(f"{label} (served) ...", file=sys.stderr)
        log = f"families-{label.replace(' ', '-')}"
        bench_args = serve_bench.parse_args(
            ["--url", url, "--model", "gemma-3-270m", "--label", label, "--num-requests", str(args.served_requests),
             "--concurrency", ",".join(map(str, LEVELS)), "--prompt-len", str(args.prompt_len),
             "--output-len", str(args.output_len), "--out", str(logs / f"{log}.json")]
        )  # fmt: skip
        with compare_peers.server(cmd, url, ready, logs / f"{log}.log", {}, 600):
            result = asyncio.run(serve_bench.bench(bench_args))
        out[label] = {f"c{r['concurrency']}": r["summary"] for r in result["runs"]}
    return out


def table(rows: list[dict], served: dict[str, dict]) -> str:
    head = (
        "| family | arch | weights MB | "
        + " | ".join(f"c={c} kvharbor tok/s | c={c} transformers | c={c} ratio" for c in LEVELS)
        + " |"
    )
    lines = [head, "|" + "---|" * (3 + 3 * len(LEVELS))]
    for r in rows:
        cells = [
            f"{r[f'c{c}'][k]:.1f}" if k != "ratio" else f"{r[f'c{c}'][k]:.2f}x"
            for c in LEVELS
            for k in ("kvharbor_tok_s", "transformers_tok_s", "ratio")
        ]
        lines.append(
            f"| {r['family']} | {r['architecture']} | {r['weight_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |"
        )
    if served:
        lines += [
            "",
            "| served (Gemma 3 270M Q4_K_M) | " + " | ".join(f"c={c} tok/s | c={c} TTFT p50 ms" for c in LEVELS) + " |",
            "|---|" + "---|---|" * len(LEVELS),
        ]
        for label, runs in served.items():
            cells = [f"{runs[f'c{c}']['output_tok_s']:.1f} | {runs[f'c{c}']['ttft_p50_s'] * 1e3:.0f}" for c in LEVELS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], served: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LEVELS), figsize=(11, 4), sharey=False)
    families, peers = [r["family"] for r in rows], list(served)
    for ax, c in zip(axes, LEVELS, strict=True):
        x = range(len(families))
        ax.bar([i - 0.2 for i in x], [r[f"c{c}"]["kvharbor_tok_s"] for r in rows], width=0.4, label="kvharbor, offline")
        ax.bar([i + 0.2 for i in x], [r[f"c{c}"]["transformers_tok_s"] for r in rows], width=0.4,
               label="transformers, same weights")  # fmt: skip
        for j, (label, colour) in enumerate(zip(peers, ("tab:green", "tab:red"), strict=False)):
            ax.bar(len(families) + j, served[label][f"c{c}"]["output_tok_s"], width=0.6, color=colour,
                   label=f"{label} (served, Gemma 3 Q4_K_M)")  # fmt: skip
        ax.set_xticks(range(len(families) + len(peers)), families + peers, rotation=35, fontsize=8)
        ax.set_title(f"concurrency {c}: decode output tok/s", fontsize=9)
    axes[1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--llama-server", help="a llama-server binary: also serve the Gemma GGUF with it and kvharbor")
    ap.add_argument("--requests", type=int, default=3, help="prompts run one after another at concurrency 1")
    ap.add_argument("--served-requests", type=int, default=16, help="requests per concurrency, served")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS / "families.json")
    args = ap.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        ap.error(f"--families: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(FAMILIES)}")
    if args.prompt_len + args.output_len <= WINDOW:
        ap.error(f"--prompt-len + --output-len must pass the {WINDOW}-token window, or the windowed path does not run")
    if args.llama_server and not Path(args.llama_server).is_file():
        ap.error(f"--llama-server {args.llama_server}: no such file (build it as benchmarks/README.md says)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvharbor-families-") as scratch:
        rows = [measure_family(f, args, Path(scratch)) for f in args.families]
    served = served_gemma(args, logs) if args.llama_server else {}
    title = f"{args.prompt_len}-token prompts, {args.output_len} output tokens, float32 — {machine_title('float32')}"
    print(title)
    print(table(rows, served))
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_record(),
        "window": WINDOW,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
        "served": served,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(rows, served, title, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
