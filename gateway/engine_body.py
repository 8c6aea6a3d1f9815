"""What the gateway sends an engine: the tenant's OpenAI body with the gateway's own fields.

Every body an engine receives is shaped here: the routed request (`engine_body`), a P/D prefill
(`prefill_body`) and the continuation of a broken stream (`continued_payload`). The client's fields
pass through as they came (the engine validates them against the same schema); the fields in
GATEWAY_FIELDS are the gateway's alone.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from kvharbor.common.model_families import template_takes_tools
from kvharbor.common.openai_api import message_dicts
from kvharbor.common.sampling_limits import MAX_CONTINUED_TEXT
from kvharbor.common.tool_calls import messages_for_template

if TYPE_CHECKING:
    from kvharbor.gateway.call import Call
    from kvharbor.gateway.engines import Engine
    from kvharbor.gateway.router import Route

# What only the gateway puts on a request to an engine; a tenant's own value never reaches one.
# cache_salt and priority come from the tenant's record (a salt of the tenant's choosing would read
# other tenants' cache); request_id is made unique per attempt (the client's stays in the logs
# and x-request-id); kv_prefix_source and kv_transfer_params make an engine pull KV from elsewhere
# or connect out, so only the router may set them.
# continued_text opens an engine's output with text of the gateway's choosing (a migrated stream's),
# text_offset places it in the client's text, and continued_tokens says how much of the prompt is
# output already (a structured output's grammar state).
GATEWAY_FIELDS = (
    "cache_salt", "priority", "request_id", "kv_prefix_source", "kv_transfer_params", "continued_text", "text_offset",
    "continued_tokens",
)  # fmt: skip


# kvharbor's own request fields, which a vLLM server would ignore or read otherwise
# (kv_transfer_params means something else there).
KVHARBOR_ONLY = ("kv_prefix_source", "kv_transfer_params", "continued_text", "text_offset", "continued_tokens",
                 "speculative")  # fmt: skip
VLLM_SALT_MAX = 128  # vLLM refuses longer salts, and any with @ / \ or NUL


def engine_body(call: Call, route: Route, engine: Engine, migratable: bool) -> dict:
    """The body for `engine` on `route`: one prompt goes as token ids (tokenized once, here), a
    P/D hand-off or the router's shared-prefix hint rides along, and a stream that may migrate
    asks for its token ids (what a migration continues from). A vLLM engine gets vllm_body's."""
    body = {
        **{k: v for k, v in call.raw.items() if k not in GATEWAY_FIELDS},
        "cache_salt": call.tenant.cache_salt,
        "priority": call.tenant.priority,
        "request_id": call.engine_rid,
        "user": call.tenant.name,
    }
    if len(call.prompts) == 1:
        body["prompt_token_ids"] = call.prompts[0]
        body.pop("prompt", None)
    else:
        body["prompt"] = call.prompts
    if call.transfer is not None:
        body["kv_transfer_params"] = call.transfer
    elif source := route.kv_prefix_source(engine):
        body["kv_prefix_source"] = source
    if call.body.stream:
        body["stream_options"] = {"include_usage": True}  # the gateway counts tokens
        if migratable:
            body["return_token_ids"] = True
    return engine.kind.shape(call, body, engine)


def vllm_body(call: Call, body: dict, priority_scheduling: bool = False) -> dict:
    """`body` as a vLLM server takes it: it ignores prompt_token_ids, so a completion's prompt goes
    as the ids themselves and a chat as its messages (vLLM renders the same template); the tenant's
    salt as vLLM's cache_salt (hashed when vLLM would refuse its characters); the tenant's priority
    negated when the server runs --scheduling-policy priority (vLLM runs lower values first,
    kvharbor higher), else none (vLLM refuses one under fcfs); none of kvharbor's own fields; a chat
    whose template takes no tools, with its tools and tool turns rendered as kvharbor renders them."""
    out = {k: v for k, v in body.items() if k not in KVHARBOR_ONLY and k != "priority"}
    if priority_scheduling and body.get("priority"):
        out["priority"] = -int(body["priority"])
    ids = out.pop("prompt_token_ids", None)
    if call.kind == "completion":
        out["prompt"] = ids if ids is not None else out.get("prompt")
    elif not template_takes_tools(call.model.tokenizer.chat_template if call.model.tokenizer else None):
        # vLLM renders the model's template, which drops `tools` and tool turns it does not take:
        # it gets them as kvharbor renders them (Hermes' form, which its hermes parser reads).
        out["messages"] = messages_for_template(message_dicts(call.body.messages), call.body.prompt_tools(), False)
    salt = out.get("cache_salt")
    if not salt:
        out.pop("cache_salt", None)
    elif len(salt) > VLLM_SALT_MAX or any(c in salt for c in "@/\\\0"):
        out["cache_salt"] = "h-" + hashlib.sha256(salt.encode()).hexdigest()[:40]
    return out


def prefill_body(body: dict) -> dict:
    """A P/D prefill of `body`: whole (not streamed), kept at the engine for a decode engine to pull,
    and computed there (no shared-prefix pull on top of a hand-off)."""
    out = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    out.pop("stream_options", None)
    out.pop("kv_prefix_source", None)
    return out


def continued_payload(
    payload: dict, call: Call, streamed: list[int], limit: int | None, moves: int, delivered: str | None = None
) -> dict:
    """The request that continues a broken stream: its prompt plus the tokens already streamed,
    as one already-tokenized prompt (no chat template again), with what is left to generate.
    Sampling settings stay the same, the seed included: a seeded stream stays a valid sample of
    the model given what was streamed, not the tokens an unbroken run would have drawn. With
    `delivered` (the text the client has), the text the failed engine held back opens the new
    output (`continued_text`), so a stop string that straddles the break is still found."""
    payload = {**payload, "prompt_token_ids": [*call.prompts[0], *streamed], "return_token_ids": True}
    payload.pop("prompt", None)
    payload.pop("kv_transfer_params", None)  # a P/D hand-off is used once; this prefill is new
    if call.kind == "completion":
        payload["echo"] = False  # the client has the prompt's echo already
        if delivered is not None:  # logprobs' text_offset goes on from the text the client has
            payload["text_offset"] = len(delivered)
    if limit is not None:
        payload.pop("max_completion_tokens", None)
        payload["max_tokens"] = limit - len(streamed)
    if payload.get("min_tokens"):
        payload["min_tokens"] = max(0, int(payload["min_tokens"]) - len(streamed))
    payload["request_id"] = f"{call.engine_rid}.m{moves}"
    payload["continued_tokens"] = len(streamed)  # a structured output's grammar walks them first
    held = held_text(call, streamed, delivered) if delivered is not None else ""
    if held:
        payload["continued_text"] = held
    return payload


def held_text(call: Call, streamed: list[int], delivered: str) -> str:
    """The text of `streamed` the client has not had: what the failed engine held back because
    it could start a stop string. "" without stop strings, without a tokenizer, or when the
    decoded tokens do not extend what was delivered (then the break is as before)."""
    body, tokenizer = call.body, call.model.tokenizer
    if not body.stop or tokenizer is None or not streamed:
        return ""
    # A last token that ends mid-character decodes to U+FFFD here; its bytes are completed by the
    # next engine's tokens, so the replacement character is not text to hand out.
    full = tokenizer.decode(streamed, skip_special_tokens=body.skip_special_tokens).rstrip("\ufffd")
    if not full.startswith(delivered) or len(full) - len(delivered) > MAX_CONTINUED_TEXT:
        return ""
    return full[len(delivered) :]
