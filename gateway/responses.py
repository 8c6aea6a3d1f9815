"""The Responses API at the gateway: `POST /v1/responses`, and a tenant's stored responses
(`GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`).

A request is read (common/responses_api.py), joined to the stored conversation it continues,
translated once to a chat request (gateway/responses_chat.py), and sent down the same path as any
chat call: the tenant's limits, admission, prefix routing (a continuation's prompt starts with the
turns before it, whose blocks are cached where they ran), retries. Its answer comes back as a
Response, or as the Responses event stream (gateway/responses_stream.py), and is stored under the
tenant (gateway/response_store.py) before the client is told it completed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvharbor.common.field_error import FieldError
from kvharbor.common.openai_api import APIError, ChatCompletionRequest
from kvharbor.common.request_body import Parsed, parse_raw
from kvharbor.common.responses_api import InputItem, ResponsesRequest
from kvharbor.gateway.call import Call
from kvharbor.gateway.flow import GuardedStream
from kvharbor.gateway.response_store import GONE_REASONS, Found
from kvharbor.gateway.responses_chat import ResponseShape, chat_request, new_id, responses_param
from kvharbor.gateway.responses_stream import ResponseEvents
from kvharbor.gateway.tenants import Tenant

log = logging.getLogger("kvharbor.gateway.responses")
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_LIST = 100  # input_items' page size at most (OpenAI's)


def conversation(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's whole conversation: what came before, its input, its output."""
    return [*record["context"], *record["input"], *record["response"]["output"]]


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as stored and listed: each with an id (OpenAI lists them by id), a message's
    text as a list of parts (as OpenAI lists it)."""
    out = []
    for item in items:
        raw = item.model_dump(exclude_none=True)
        if raw["type"] == "message" and isinstance(raw["content"], str):
            part = "output_text" if raw["role"] == "assistant" else "input_text"
            raw["content"] = [{"type": part, "text": raw["content"]}]
        out.append({"id": raw.get("id") or new_id(ITEM_ID_PREFIX[raw["type"]]), **raw})
    return out


class ResponsesAPI:
    """The endpoints; `handler` is the app's front matter (gateway/app.py), `state.responses` the store."""

    def __init__(self, handler: Any) -> None:
        self.handler, self.state = handler, handler.state

    def install(self, app: Any) -> None:
        app.post("/v1/responses")(self.create)
        app.get("/v1/responses/{response_id}")(self.retrieve)
        app.delete("/v1/responses/{response_id}")(self.delete)
        app.get("/v1/responses/{response_id}/input_items")(self.input_items)
        app.post("/v1/responses/{response_id}/cancel")(self.cancel)

    # -- the store ---------------------------------------------------------------------------------

    async def _find(self, tenant: Tenant, rid: str, param: str) -> dict[str, Any]:
        try:
            found: Found = await self.state.responses.get(tenant.name, rid)
        except Exception as exc:
            raise self._unavailable(exc) from None
        if found.record is not None:
            return found.record
        if found.gone in GONE_REASONS:
            self.state.metrics.responses_missed.labels("evicted").inc()
            raise APIError(404, f"response {rid[:80]!r} is no longer stored: {GONE_REASONS[found.gone]}; send the "
                           "conversation again as input", param=param, code="response_evicted")  # fmt: skip
        self.state.metrics.responses_missed.labels("unknown").inc()
        ttl = self.state.responses_ttl
        raise APIError(404, f"no stored response {rid[:80]!r} for this API key's tenant (responses are kept "
                       f"{ttl:.0f}s after they are written, and only with store: true)", param=param,
                       code="response_not_found")  # fmt: skip

    def _unavailable(self, exc: Exception) -> APIError:
        log.warning("response store unavailable", extra={"error": repr(exc)[:300]})
        self.state.metrics.responses_store_failures.inc()
        return APIError(503, "the response store is unavailable; retry shortly, or send the whole conversation as "
                        "input without previous_response_id", type="service_unavailable", code="store_unavailable",
                        headers={"Retry-After": "1"})  # fmt: skip

    async def _store(self, tenant: Tenant, record: dict[str, Any]) -> APIError | None:
        """Writes `record`; None once stored, else the 503 that says why it was not."""
        try:
            written = await self.state.responses.put(tenant.name, record["response"]["id"], record)
        except Exception as exc:
            return self._unavailable(exc)
        m = self.state.metrics
        m.responses_evicted.labels("ttl").inc(written.expired)
        m.responses_evicted.labels("budget").inc(written.evicted)
        if written.too_large:
            m.responses_evicted.labels("too_large").inc()
        return None

    # -- POST /v1/responses ------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        tenant = self.handler._tenant(request)
        parsed = await self.handler._parse(request, ResponsesRequest)
        req: ResponsesRequest = parsed.body
        context, affinity = await self._continued(tenant, req)
        items = req.input_items()
        shape = ResponseShape(req)
        record = {"response": None, "input": stored_items(items), "context": context}
        try:
            call = await self._chat_call(request, tenant, parsed, context, items)
            call.affinity = affinity  # routed where the last turn ran, if its prefix is this one's
            answer = await self.handler._run(request, call)
        except APIError as exc:
            raise _renamed(exc, req) from None

        async def settle(response: dict[str, Any]) -> APIError | None:
            record["response"] = response
            if call.served_by and call.hashes:  # where this turn's prompt is cached: the next turn goes there
                last = call.hashes[-1].hex()
                record["served"] = {"instance": call.served_by, "blocks": len(call.hashes), "last": last}
            return await self._store(tenant, record) if req.store else None

        if isinstance(answer, GuardedStream):
            return answer.mapped(ResponseEvents(shape, settle).run(answer.body_iterator))
        response = shape.from_chat(json.loads(answer.body))
        if (refusal := await settle(response)) is not None:
            raise refusal
        return JSONResponse(response, headers=_passed_headers(answer))

    async def _continued(self, tenant: Tenant, req: ResponsesRequest) -> tuple[list[dict[str, Any]], dict | None]:
        """The conversation `req` continues (none without previous_response_id), and where its
        last turn ran."""
        if req.previous_response_id is None:
            return [], None
        before = await self._find(tenant, req.previous_response_id, "previous_response_id")
        if before["response"]["status"] == "failed":
            raise APIError(400, f"response {req.previous_response_id!r} failed: continue from one that completed",
                           param="previous_response_id", code="response_failed")  # fmt: skip
        return conversation(before), before.get("served")

    async def _chat_call(self, request: Request, tenant: Tenant, parsed: Parsed, context: list[dict[str, Any]],
                         items: list[InputItem]) -> Call:  # fmt: skip
        """The chat call of the request, read and checked as any chat call is."""
        req: ResponsesRequest = parsed.body
        try:
            chat = parse_raw(chat_request(req, context, items), ChatCompletionRequest, self.state.limits)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        call = await self.handler._call_from(request, "chat", tenant, Parsed(chat.body, chat.raw, parsed.ignored))
        tokenizer = call.model.tokenizer
        if req.reasoning is not None and not (tokenizer and tokenizer.reasoning_parser):
            # A model that writes no reasoning apart: `reasoning` is accepted, and said to be ignored.
            call.ignored = Parsed(None, {}, (*parsed.ignored, "reasoning")).headers()
        return call

    # -- the stored ones ---------------------------------------------------------------------------

    async def retrieve(self, request: Request, response_id: str) -> dict[str, Any]:
        tenant = self.handler._tenant(request)
        return (await self._find(tenant, response_id, "response_id"))["response"]

    async def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        tenant = self.handler._tenant(request)
        await self._find(tenant, response_id, "response_id")
        try:
            await self.state.responses.delete(tenant.name, response_id)
        except Exception as exc:
            raise self._unavailable(exc) from None
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, request: Request, response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict[str, Any]:  # fmt: skip
        tenant = self.handler._tenant(request)
        if not 1 <= limit <= MAX_LIST:
            raise APIError(400, f"limit must be 1 to {MAX_LIST}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, 'order must be "asc" or "desc"', param="order")
        items = list((await self._find(tenant, response_id, "response_id"))["input"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after names no input item of response {response_id[:80]!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip

    async def cancel(self, request: Request, response_id: str) -> Response:
        tenant = self.handler._tenant(request)
        await self._find(tenant, response_id, "response_id")
        raise APIError(400, "only background responses can be cancelled, and kvharbor runs none: a response ends "
                       "when its request does (close a stream to stop it)", param="response_id",
                       code="not_background")  # fmt: skip


def _renamed(exc: APIError, req: ResponsesRequest) -> APIError:
    """A chat-shaped 400 in the Responses request's terms: its field, and for a continued
    conversation that no longer fits, the response it continues."""
    param = responses_param(exc.param)
    if param in ("input", "prompt") and req.previous_response_id is not None:  # the whole prompt: its length
        param = "previous_response_id"
        exc.message = f"{exc.message} (the conversation continued from previous_response_id no longer fits: start a " \
                      "new one, or send a shorter history as input)"  # fmt: skip
    exc.param = param
    return exc


def _passed_headers(answer: Response) -> dict[str, str]:
    """The chat answer's headers a Response keeps (request id, rate limits, ignored fields)."""
    return {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
