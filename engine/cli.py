"""`kvharbor generate "prompt"` and `kvharbor chat "message"`: one offline generation, streamed.

Engine options come from flags, KVHARBOR_* variables or a YAML file (--config), with the same
names everywhere. Progress goes to stderr, the answer to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvharbor.common.config import ConfigError, add_arguments, load_config

# Sampling flags: (flag, type, default, help). Defaults suit a terminal: greedy unless asked.
_SAMPLING = [
    ("--max-tokens", int, 256, "most tokens to generate"),
    ("--temperature", float, 0.0, "0 is greedy"),
    ("--top-p", float, 1.0, "nucleus sampling mass in (0, 1]"),
    ("--top-k", int, 0, "keep the k most likely tokens (0: all)"),
    ("--min-p", float, 0.0, "drop tokens below min_p x the most likely"),
    ("--seed", int, None, "seed of this request's sampler"),
    ("--repetition-penalty", float, 1.0, "> 1 discourages repeats"),
]


def build_parser(prog: str, command: str) -> argparse.ArgumentParser:
    from kvharbor.engine.config import EngineConfig

    what = "message, rendered with the model's chat template" if command == "chat" else "prompt text"
    from kvharbor.common import __version__

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvharbor {__version__}")
    parser.add_argument("text", help=f"the {what}")
    parser.add_argument("--config", metavar="FILE", help="YAML file of engine options [env KVHARBOR_CONFIG]")
    if command == "chat":
        parser.add_argument("--system", help="a system message to put first")
    group = parser.add_argument_group("sampling")
    for flag, tp, default, help_text in _SAMPLING:
        group.add_argument(flag, type=tp, default=default, help=f"{help_text} (default: {default})")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_arguments(parser.add_argument_group("engine"), EngineConfig)
    return parser


def main(argv: list[str], prog: str = "kvharbor generate", command: str = "generate") -> int:
    parser = build_parser(prog, command)
    args = parser.parse_args(argv)
    from kvharbor.engine.config import EngineConfig
    from kvharbor.engine.llm_engine import LLMEngine
    from kvharbor.engine.sampling_params import SamplingParams

    sampling_names = {f[0][2:].replace("-", "_") for f in _SAMPLING} | {"stop"}
    skip = sampling_names | {"text", "config", "system"}
    try:
        config = load_config(
            EngineConfig, file=args.config, overrides={k: v for k, v in vars(args).items() if k not in skip}
        )
        params = SamplingParams(**{k: getattr(args, k) for k in sampling_names})
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    try:
        engine = LLMEngine(config, progress=lambda msg: print(f"[kvharbor] {msg}", file=sys.stderr, flush=True))
        prompt_ids = _prompt_ids(engine, args, command)
        engine.add_request("cli-0", None, params, prompt_token_ids=prompt_ids)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvharbor: error: {exc}", file=sys.stderr)
        return 2
    return _stream(engine)


def _prompt_ids(engine, args: argparse.Namespace, command: str) -> list[int]:
    tok = engine.core.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer, so it cannot take text; use the Python API with token ids")
    if command == "generate":
        return tok.encode(args.text)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.text}
    ]
    return tok.encode_chat(messages)


def _stream(engine) -> int:
    t0 = time.monotonic()
    first = None
    reason = "abort"
    n_tokens = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sample = out.outputs[0]
                if sample.delta_text:
                    first = first or time.monotonic()
                    sys.stdout.write(sample.delta_text)
                    sys.stdout.flush()
                n_tokens = len(sample.token_ids)
                if out.finished:
                    reason = sample.finish_reason or reason
                    if out.error:
                        print(f"\nkvharbor: error: {out.error}", file=sys.stderr)
                        return 1
    except KeyboardInterrupt:
        engine.abort("cli-0")
        print("\n[kvharbor] interrupted", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - t0
    ttft = f"{(first - t0):.2f}s" if first else "n/a"
    print(file=sys.stdout)
    print(
        f"[kvharbor] {n_tokens} tokens in {elapsed:.2f}s (first token {ttft}), finish reason: {reason}", file=sys.stderr
    )
    return 0
