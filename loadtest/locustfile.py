"""Locust personas against the platform's OpenAI API (streamed), with TTFT and ITL as custom metrics.

    chat   a chat assistant: a few long shared system prompts, short questions (prefix reuse)
    docqa  document Q&A: long unique contexts, one question each
    batch  low-priority (sheddable) summarization, steady pacing

Every request streams; its time to first token and its inter-token latencies go to Locust as
request types "TTFT" and "ITL" next to the whole request, and one JSON line per request goes to
$KVHARBOR_LOADTEST_RECORDS for loadtest/run.py's report.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from locust import HttpUser, between, constant_pacing, task
from personas import QUESTIONS, SYSTEM_PROMPTS, text

from kvharbor.launch.loadtest_tenants import LOADTEST_TENANTS as TENANTS

MODEL = os.environ.get("KVHARBOR_LOADTEST_MODEL", "SmolLM2-135M-Instruct")
RECORDS = os.environ.get("KVHARBOR_LOADTEST_RECORDS")
_lock = threading.Lock()


def _record(row: dict) -> None:
    if RECORDS:
        with _lock, open(RECORDS, "a") as out:
            out.write(json.dumps(row) + "\n")


class _Persona(HttpUser):
    abstract = True
    tenant = ""
    max_tokens = 32

    def on_start(self) -> None:
        self.rng = random.Random()
        self.key = TENANTS[self.tenant][0]

    def chat(self, messages: list[dict]) -> None:
        body = {"model": MODEL, "messages": messages, "max_tokens": self.max_tokens, "stream": True, "temperature": 0.7}
        headers = {"Authorization": f"Bearer {self.key}"}
        start = time.perf_counter()
        row = {
            "tenant": self.tenant,
            "t": time.time(),
            "ok": False,
            "status": 0,
            "ttft_ms": None,
            "itl_ms": [],
            "tokens": 0,
        }
        last = None
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True, catch_response=True,
                              name=f"{self.tenant} chat", timeout=300) as resp:  # fmt: skip
            row["status"] = resp.status_code
            if resp.status_code != 200:
                row["reason"] = _reason(resp)
                resp.failure(f"HTTP {resp.status_code} {row['reason']}")
                _record(row)
                if resp.status_code == 401:  # the gateway does not know this key: stop, run.py says why
                    self.environment.runner.quit()
                return
            try:
                for raw in resp.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"].get("message", "stream error"))
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        now = time.perf_counter()
                        if last is None:
                            row["ttft_ms"] = (now - start) * 1000
                            self._metric("TTFT", row["ttft_ms"])
                        else:
                            gap = (now - last) * 1000
                            row["itl_ms"].append(gap)
                            self._metric("ITL", gap)
                        last = now
                        row["tokens"] += 1
                row["ok"] = row["ttft_ms"] is not None
                resp.success() if row["ok"] else resp.failure("no tokens")
            except Exception as exc:
                row["reason"] = f"stream: {exc}"[:120]
                resp.failure(row["reason"])
        _record(row)

    def _metric(self, kind: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=self.tenant, response_time=ms, response_length=0, exception=None, context={}
        )


def _reason(resp) -> str:
    try:
        return resp.json()["error"].get("code") or str(resp.status_code)
    except Exception:
        return str(resp.status_code)


class ChatAssistant(_Persona):
    tenant = "chat"
    weight = 3
    wait_time = between(0.5, 2.0)
    max_tokens = 24

    @task
    def ask(self) -> None:
        system = self.rng.choice(SYSTEM_PROMPTS)
        self.chat([{"role": "system", "content": system}, {"role": "user", "content": self.rng.choice(QUESTIONS)}])


class DocumentQA(_Persona):
    tenant = "docqa"
    weight = 1
    wait_time = between(2.0, 4.0)
    max_tokens = 32

    @task
    def ask(self) -> None:
        document = text(self.rng, 500)  # unique: nothing to reuse
        self.chat([{"role": "user", "content": f"Document:\n{document}\n\nQuestion: what is it about?"}])


class BatchSummaries(_Persona):
    tenant = "batch"
    weight = 1
    wait_time = constant_pacing(3.0)
    max_tokens = 64

    @task
    def summarize(self) -> None:
        self.chat([{"role": "user", "content": "Summarize: " + text(self.rng, 200)}])
