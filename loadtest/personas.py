"""The load test's tenants: who they are, their keys, and the prompts they send.

Shared by the locustfile (which sends the traffic) and run.py (which writes the tenants file for a
platform it starts, and judges the results).
"""

from __future__ import annotations

import hashlib
import random

WORDS = (
    "system", "service", "request", "model", "engine", "cache", "token", "prefix", "block", "latency",
    "budget", "tenant", "policy", "route", "queue", "memory", "kernel", "stream", "gateway", "index",
    "shard", "replica", "lease", "event", "store", "batch",
)  # fmt: skip

# name -> (API key, priority)
TENANTS = {
    "chat": ("sk-load-chat", 0),
    "docqa": ("sk-load-docqa", 0),
    "batch": ("sk-load-batch", -1),
}


def tenants_yaml() -> dict:
    """The gateway tenants file for these personas (keys hashed, as the gateway wants them)."""
    rows = []
    for name, (key, priority) in TENANTS.items():
        digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
        rows.append({"name": name, "api_keys": [digest], "priority": priority, "models": ["*"]})
    return {"tenants": rows}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# A few long system prompts that every chat user shares (prefix reuse across users).
SYSTEM_PROMPTS = [f"You are assistant number {i}. Policy: " + text(random.Random(i), 300) for i in range(3)]
QUESTIONS = ["Summarize the policy.", "What should I do first?", "List three risks.", "Explain it simply."]
