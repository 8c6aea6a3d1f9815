"""The load test's tenants: who they are, their keys, and the prompts they send.

Shared by the locustfile (which sends the traffic) and run.py (which judges the results). The
tenants themselves live in kvharbor.launch.loadtest_tenants, which `kvharbor up --loadtest-tenants`
loads into the gateway.
"""

from __future__ import annotations

import random

WORDS = (
    "system", "service", "request", "model", "engine", "cache", "token", "prefix", "block", "latency",
    "budget", "tenant", "policy", "route", "queue", "memory", "kernel", "stream", "gateway", "index",
    "shard", "replica", "lease", "event", "store", "batch",
)  # fmt: skip

def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# A few long system prompts that every chat user shares (prefix reuse across users).
SYSTEM_PROMPTS = [f"You are assistant number {i}. Policy: " + text(random.Random(i), 300) for i in range(3)]
QUESTIONS = ["Summarize the policy.", "What should I do first?", "List three risks.", "Explain it simply."]
