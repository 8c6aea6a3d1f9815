"""Greedy agreement of `--quantization gguf` with llama.cpp on the same GGUF file: does kvharbor
run a GGUF's blocks as llama.cpp does, and where it differs, is it rounding or a bug?

Three generators, greedy, on the same prompt token ids (the model's chat template, rendered once
by kvharbor's tokenizer and sent to llama-server as ids, so no tokenizer differs):
- `float32`: kvharbor on the file's weights dequantized to float32 (`--quantization none`): the
  reference, the closest either engine could come to the file's values;
- `gguf`: kvharbor on the file's own blocks (`--quantization gguf`: int8 activations per group of
  32 against the 4-bit groups, as llama.cpp's Q8 dot products take them);
- `llama.cpp`: llama-server (--llama-server BIN, started here on the file, or --peer-url).

Prompts: HELD_OUT, questions of our own (none from loadtest/ or the tests), and the README's first
example. Each pair of generators gets its exact-match length (tokens before the first difference,
mean over prompts) and the prompts matched in full. Where llama.cpp agrees with float32 further
than kvharbor's gguf does, the report gives float32's margin at kvharbor's first difference (its
top logit minus the token gguf chose, teacher-forced along float32's own tokens): a margin of a few
hundredths is a near-tie that any rounding can flip; a large one would point at a bug.

    python benchmarks/gguf_agreement.py --llama-server /path/to/llama-server [--tokens 48]

Prints a table, writes benchmarks/results/gguf_agreement.json. Build llama-server as
benchmarks/README.md says.
"""

# isort: split
import kvharbor.engine  # noqa: F401  (before torch: the OpenMP wait policy, engine/omp_policy.py)

# isort: split
import argparse
import json
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peers
from quality import matched_prefix, teacher_forced_logits

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.common.model_files import default_model_path
from kvharbor.engine import LLM, SamplingParams
from kvharbor.engine.model.loader import load_model
from kvharbor.launch.embedded_redis import free_port

RESULTS = Path(__file__).resolve().parent / "results"
README_PROMPT = "What is the capital of France?"
HELD_OUT = (
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
    "Write one sentence about the ocean.",
    "What is 12 times 11?",
    "Which planet is known as the red planet?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "Explain what a verb is in one sentence.",
    "What do bees make?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "Why do leaves change color in autumn?",
    "What is the opposite of cold?",
    "How many days are in a leap year?",
    "Translate 'thank you' into Spanish.",
    "What is the largest mammal on Earth?",
    "Describe a bicycle in one sentence.",
    "What gas do plants take in from the air?",
    "Who wrote Romeo and Juliet?",
    "What is the square root of 81?",
    "List two fruits that are yellow.",
)
GENERATORS = ("float32", "gguf", "llama.cpp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help="a llama-server binary to start on the GGUF")
    parser.add_argument("--peer-url", help="a llama-server already serving the same GGUF, instead of starting one")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the bundled SmolLM2's)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--out", type=Path, default=RESULTS / "gguf_agreement.json")
    args = parser.parse_args(argv)
    if bool(args.llama_server) == bool(args.peer_url):
        parser.error("give --llama-server BIN or --peer-url URL (one of them)")
    if not 1 <= args.tokens <= 512:
        parser.error("--tokens must be 1-512")
    args.gguf = args.gguf or default_model_path()
    if not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    return args


def kvharbor_greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def llama_greedy(url: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """llama-server's greedy tokens for each prompt, sent as ids (EOS ignored, no prompt cache)."""
    out = []
    with httpx.Client(timeout=300) as client:
        for ids in prompts:
            body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True, "seed": 0}  # fmt: skip
            reply = client.post(f"{url}/completion", json=body)
            reply.raise_for_status()
            got = reply.json().get("tokens")
            if not isinstance(got, list):
                raise RuntimeError("llama-server gave no `tokens` (return_tokens): use a llama.cpp of 2025 or later")
            out.append([int(t) for t in got])
    return out


def run_llama(args: argparse.Namespace, prompts: list[list[int]], logs: Path) -> list[list[int]]:
    if args.peer_url:
        return llama_greedy(args.peer_url, prompts, args.tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
           "-np", "1", "-c", "4096", "-ngl", "0"]  # fmt: skip
    print("llama-server ...", file=sys.stderr)
    with compare_peers.server(cmd, url, "/health", logs / "llama-server-agreement.log", {}, 300):
        return llama_greedy(url, prompts, args.tokens)


def margin_at(llm: LLM, prompt: list[int], ref: list[int], at: int, chosen: int) -> float:
    """float32's top logit minus its logit of `chosen`, after prompt + ref[:at]."""
    logits = teacher_forced_logits(llm, prompt + ref[:at])[-1]
    return float(logits.max() - logits[chosen])


def pair(a: list[list[int]], b: list[list[int]]) -> dict:
    lengths = [matched_prefix(x, y) for x, y in zip(a, b, strict=True)]
    full = sum(n == len(x) for n, x in zip(lengths, a, strict=True))
    return {"mean_match": sum(lengths) / len(lengths), "full": full, "lengths": lengths}


def falls_behind(greedy: dict[str, list[list[int]]], questions: tuple[str, ...], margin) -> list[dict]:
    """The prompts where llama.cpp follows float32 further than kvharbor's gguf does, with
    float32's margin (`margin(prompt index, position, gguf's token)`) at gguf's first difference."""
    out = []
    for i, (ref, ours, theirs) in enumerate(zip(greedy["float32"], greedy["gguf"], greedy["llama.cpp"], strict=True)):
        at = matched_prefix(ours, ref)
        if matched_prefix(theirs, ref) > at:
            out.append({"prompt": questions[i], "at": at, "float32_token": ref[at], "gguf_token": ours[at],
                        "float32_margin": margin(i, at, ours[at])})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    # float32 on the file dequantized; gguf on its own blocks (kept only when asked for).
    loaded = {"none": load_model(str(args.gguf)), "gguf": load_model(str(args.gguf), keep_blocks=True)}
    llms = {name: LLM(loaded_model=loaded[q], dtype="float32", quantization=q, max_model_len=2048, num_kv_blocks=256)
            for name, q in (("float32", "none"), ("gguf", "gguf"))}  # fmt: skip
    tokenizer = llms["float32"].get_tokenizer()
    questions = (README_PROMPT, *HELD_OUT)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    greedy = {name: kvharbor_greedy(llm, prompts, args.tokens) for name, llm in llms.items()}
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    greedy["llama.cpp"] = run_llama(args, prompts, logs)
    pairs = {f"{a} / {b}": pair(greedy[a], greedy[b]) for a, b in (("gguf", "float32"), ("llama.cpp", "float32"),
                                                                    ("gguf", "llama.cpp"))}  # fmt: skip
    margin = lambda i, at, token: margin_at(llms["float32"], prompts[i], greedy["float32"][i], at, token)  # noqa: E731
    behind = falls_behind(greedy, questions, margin)
    answers = {name: tokenizer.decode(greedy[name][0]) for name in GENERATORS}
    report(pairs, behind, answers, len(prompts), args.tokens)
    record = {"benchmark": "gguf_agreement", "machine": machine_record(), "gguf": str(args.gguf), "tokens": args.tokens,
              "prompts": list(questions), "greedy": greedy, "pairs": pairs, "gguf_behind_llama_cpp": behind,
              "readme_answers": answers}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


def report(pairs: dict, behind: list[dict], answers: dict, prompts: int, tokens: int) -> None:
    print(f"greedy agreement on {prompts} prompts x {tokens} tokens, {machine_title()}")
    print(f"{'pair':24} {'mean match':>10} {'full':>6}")
    for name, p in pairs.items():
        print(f"{name:24} {p['mean_match']:10.1f} {p['full']:4}/{prompts}")
    for b in behind:
        print(f"  gguf leaves float32 at token {b['at']} of {b['prompt']!r} where llama.cpp follows it: "
              f"float32's margin there {b['float32_margin']:.3f}")  # fmt: skip
    for name, text in answers.items():
        print(f"  {README_PROMPT!r} {name}: {text[:60]!r}")


if __name__ == "__main__":
    sys.exit(main())
