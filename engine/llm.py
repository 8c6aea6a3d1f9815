"""LLM: offline batch generation in the shape vLLM users know."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvharbor.common.config import load_config
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.config import EngineConfig
from kvharbor.engine.llm_engine import LLMEngine, Progress
from kvharbor.engine.model.loader import LoadedModel
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.pooling import finish_vector
from kvharbor.engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]


SPECULATIVE_KEYS = {"method": "speculative_method", "k": "speculative_k", "ngram_n": "ngram_n",
                    "draft_model": "draft_model"}  # fmt: skip


def _flatten_speculative(options: dict[str, Any]) -> dict[str, Any]:
    """`speculative={"method": "ngram", "k": 3, ...}` -> the config leaves speculative_method, ..."""
    spec = options.get("speculative")
    if spec is None:
        return options
    if not isinstance(spec, dict) or set(spec) - set(SPECULATIVE_KEYS):
        raise ValueError(f"speculative must be a dict with keys from {sorted(SPECULATIVE_KEYS)}, got {spec!r}")
    rest = {k: v for k, v in options.items() if k != "speculative"}
    return rest | {SPECULATIVE_KEYS[k]: v for k, v in spec.items()}


class LLM:
    """`LLM(model=None | path, dtype='auto' | 'float32' | 'bfloat16', **engine_options)`.

    `engine_options` are EngineConfig leaves by name (block_size=16, num_kv_blocks=64, ...);
    `speculative={"method": "ngram" | "draft", "k": 3, "ngram_n": 3, "draft_model": path}` too;
    LoRA adapters as `lora=["NAME=PATH", ...]` (and max_loras=, max_lora_rank=, ...).
    The Python API reads no environment or file: what you pass is what runs.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        *,
        progress: Progress | None = None,
        loaded_model: LoadedModel | None = None,
        kv_save: str | None = None,
        **engine_options: Any,
    ) -> None:
        """`loaded_model` reuses weights already read by `engine.loader.load_model` (then `model`
        is ignored): several engines over one model pay for one load. `kv_save` (all, hot,
        evict): copy blocks out for a shared-store client (engine/kv/kv_offload.py) to write."""
        engine_options = _flatten_speculative(engine_options)
        config = load_config(EngineConfig, env={}, overrides={"model": model, "dtype": dtype, **engine_options})
        self.engine = LLMEngine(config, progress=progress, loaded_model=loaded_model, kv_save=kv_save)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.core.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order. A prompt is text, a list of token ids,
        or {"prompt_token_ids": [...]}. `lora`: the adapter (by name) for every prompt, or one per
        prompt (None: the base model). If any prompt is invalid, ValueError is raised and
        nothing runs."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(batch), "sampling_params")
        prios = _per_prompt(list(priority) if priority is not None else 0, len(batch), "priority")
        adapters = _per_prompt(list(lora) if isinstance(lora, (list, tuple)) else lora, len(batch), "lora")
        ids = [f"gen-{next(self._ids)}" for _ in batch]
        added: list[str] = []
        try:
            for rid, prompt, p, prio, adapter in zip(ids, batch, params, prios, adapters, strict=True):
                self._add(rid, prompt, p, prio, adapter)
                added.append(rid)
        except ValueError:
            self.engine.abort(added)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.core.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chats")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(c)} for c in convs]
        return self.generate(prompts, sampling_params)

    def embed(self, prompts: PromptInput | Sequence[PromptInput], dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt, in order, pooled as the engine's model declares (engine/pooling.py),
        cut to `dimensions` and normalized where the model normalizes. The engine's task must be embed."""
        pooling = self.engine.core.pooling
        if pooling is None:
            raise ValueError("this engine generates (task generate): build it with task='embed' or an embedding model")
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling.mode)
        outs = self.generate(prompts, params)
        return [finish_vector(o.embedding, pooling.normalize, dimensions) for o in outs]

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (the engine must have LoRA on: enable_lora=True
        or lora=[...]). Raises lora.AdapterError (a ValueError) and loads nothing on bad input."""
        from kvharbor.engine.lora.adapter import load_adapter

        lora = self.engine.core.config.lora
        self.engine.core.load_lora(load_adapter(name, path, self.engine.core.arch, lora.max_lora_rank))

    def unload_lora(self, name: str) -> None:
        self.engine.core.unload_lora(name)

    def _add(self, rid: str, prompt: PromptInput, params: SamplingParams, priority: int, lora: str | None) -> None:
        if isinstance(prompt, str):
            self.engine.add_request(rid, prompt, params, priority=priority, lora=lora)
        elif isinstance(prompt, dict):
            self.engine.add_request(
                rid, prompt.get("prompt"), params, priority=priority, prompt_token_ids=prompt.get("prompt_token_ids"),
                lora=lora,
            )  # fmt: skip
        else:
            self.engine.add_request(rid, None, params, priority=priority, prompt_token_ids=list(prompt), lora=lora)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value: Any, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
