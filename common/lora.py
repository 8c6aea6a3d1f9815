"""LoRA adapter names and identities: what the engine, the gateway and the operator agree on.

An adapter is asked for by name in the OpenAI `model` field (vLLM's convention). Its *identity*
is the name bound to its weights (`name@digest`, the digest of its safetensors file and rank):
that identity goes into the block-hash namespace (common/block_hash.py), so KV computed under one
adapter never hits under another, under the base model, or under a reloaded adapter of the same
name with other weights. Engines report name -> identity in their load report; the gateway hashes
a prompt for an adapter with the identity the engines report.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_adapter_name(name: object) -> str:
    """Return `name` if it can name an adapter, else raise ValueError saying what is allowed."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"adapter name {name!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def adapter_identity(name: str, digest: str) -> str:
    """The identity hashed into an adapter's KV namespace."""
    return f"{check_adapter_name(name)}@{digest}"


def parse_lora_spec(spec: str) -> tuple[str, str]:
    """'NAME=PATH' (the --lora flag) -> (name, path); raises ValueError naming the fix."""
    name, sep, path = spec.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"--lora takes NAME=PATH (an adapter folder), got {spec!r}")
    return check_adapter_name(name.strip()), path.strip()
