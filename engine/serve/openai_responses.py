"""OpenAI response bodies from engine outputs: whole responses, SSE chunks, usage and logprobs."""

from __future__ import annotations

import json
import time
from typing import Any

from kvharbor.common.reasoning import ReasoningStream, split_reasoning
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.common.tool_calls import ToolUse
from kvharbor.engine.outputs import CompletionOutput, RequestOutput
from kvharbor.engine.request import Logprob
from kvharbor.engine.serve.tool_responses import ToolCallStream, tool_message


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def request_usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Usage over every prompt and sample of one API request."""
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
        sum(o.num_cached_tokens for o in outputs),
    )


def finish_reason(sample: CompletionOutput) -> str | None:
    return sample.finish_reason


class ResponseBuilder:
    """Shapes for one API request: `kind` is "chat" or "completion"."""

    def __init__(
        self,
        kind: str,
        response_id: str,
        model: str,
        tokenizer: Tokenizer | None,
        n: int,
        token_ids: bool = False,
        text_offset: int = 0,
        tools: ToolUse | None = None,
        reasoning: str | None = None,
    ) -> None:
        self.kind = kind
        self.tools = tools or ToolUse()  # a chat's tools (common/tool_calls.py): what they make of its output
        self._tool_streams: dict[int, ToolCallStream] = {}
        # A chat's reasoning parser (common/reasoning.py, by family): its reasoning goes apart.
        self.reasoning = reasoning if kind == "chat" else None
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        self.text_offset = text_offset  # where each choice's text starts in the client's (completions' logprobs)
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice carries its (delta) token ids
        self.id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.n = n
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    # -- logprobs ---------------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", []
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, entries: list[Logprob]) -> dict[str, Any]:
        content = []
        for lp in entries:
            token, raw = self._token(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": value, "bytes": b})
            content.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, entries: list[Logprob], text_offset: int) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for lp in entries:
            token, _ = self._token(lp.token_id)
            tokens.append(token)
            values.append(lp.logprob)
            tops.append({self._token(tid)[0]: v for tid, v in lp.top})
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # -- whole responses --------------------------------------------------------------------------

    def response(self, outputs: list[RequestOutput], want_logprobs: bool, echo_prefix: list[str]) -> dict:
        """The non-streamed body for the finished outputs of every prompt of the request."""
        choices = []
        for k, out in enumerate(outputs):
            for sample in out.outputs:
                choices.append(self._choice(k * self.n + sample.index, sample, want_logprobs, echo_prefix[k]))
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": request_usage(outputs),
        }

    def _choice(self, index: int, sample: CompletionOutput, want_logprobs: bool, prefix: str) -> dict:
        lps = sample.logprobs or []
        if self.kind == "chat":
            thought, text = split_reasoning(sample.text, self.reasoning) if self.reasoning else (None, sample.text)
            message, reason = {"role": "assistant", "content": text}, finish_reason(sample)
            if self.tools.mode != "none":
                message, reason = tool_message(text, reason, self.tools)
            if thought is not None:
                message["reasoning"] = thought
            choice = {
                "index": index,
                "message": message,
                "logprobs": self.chat_logprobs(lps) if want_logprobs else None,
                "finish_reason": reason,
            }
        else:
            choice = {
                "index": index,
                "text": prefix + sample.text,
                "logprobs": self.completion_logprobs(lps, self.text_offset + len(prefix)) if want_logprobs else None,
                "finish_reason": finish_reason(sample),
            }
        if self.token_ids:
            choice["token_ids"] = list(sample.token_ids)
        return choice

    # -- streamed chunks --------------------------------------------------------------------------

    def _chunk(self, choices: list[dict], **extra: Any) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        return self._chunk(
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def delta_chunk(
        self, index: int, sample: CompletionOutput, want_logprobs: bool, text_offset: int
    ) -> dict | None:
        """The chunk for `sample`'s delta; None when a tool call holds it back for now."""
        reason = finish_reason(sample)
        if self.kind == "chat":
            lp = self.chat_logprobs(sample.delta_logprobs) if want_logprobs else None
            thought, text = self._reasoning_delta(index, sample.delta_text, reason is not None)
            if self.reasoning and sample.delta_text and not (thought or text or reason):
                return None  # held back: it may be a tag
            delta = {"content": text} if text or reason is None else {}
            if self.tools.mode != "none":
                stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
                delta, reason = stream.delta(text, reason)
                if delta is None and not thought:
                    return None
                delta = delta or {}
            if thought:
                delta = {"reasoning": thought, **{k: v for k, v in delta.items() if k != "content" or v}}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            lp = self.completion_logprobs(sample.delta_logprobs, text_offset) if want_logprobs else None
            choice = {"index": index, "text": sample.delta_text, "logprobs": lp, "finish_reason": reason}
        if self.token_ids:
            choice["token_ids"] = list(sample.delta_token_ids)
        return self._chunk([choice])

    def _reasoning_delta(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) of one choice's text delta."""
        if self.reasoning is None:
            return "", text
        stream = self._reasoning_streams.setdefault(index, ReasoningStream(self.reasoning))
        return stream.delta(text, finished)

    def text_chunk(self, index: int, text: str) -> dict:
        """A completion chunk of plain text (the echoed prompt)."""
        return self._chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self._chunk([], usage=request_usage(outputs))
