"""Export a model kvharbor loads (default: the bundled SmolLM2 GGUF) as a Hugging Face folder,
so peers without a GGUF loader (vLLM's CPU build) can serve the very same weights.

    python benchmarks/export_hf.py OUT_DIR [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.model.loader import load_model


def export(out: Path, model: str | None = None) -> Path:
    loaded = load_model(model)
    out.mkdir(parents=True, exist_ok=True)
    hf_reference_model(loaded).save_pretrained(out)
    tok = loaded.tokenizer
    if tok is not None:
        tok.backend.save(str(out / "tokenizer.json"))
        special = tok.backend.get_added_tokens_decoder()
        eos = special[tok.eos_token_ids[0]].content if tok.eos_token_ids else None
        bos = special[tok.bos_token_id].content if tok.bos_token_id in special else None
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": tok.chat_template,
            "eos_token": eos,
            "bos_token": bos,
            "pad_token": eos,
            "add_bos_token": tok.add_bos,
            "model_max_length": loaded.arch.max_position_embeddings,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None, help="a .gguf file or HF folder (default: the bundled SmolLM2)")
    args = ap.parse_args()
    print(f"wrote {export(args.out, args.model)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
