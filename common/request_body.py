"""The one way an HTTP edge reads an OpenAI request body, against the server's RequestLimits.

Every HTTP edge that takes OpenAI requests (the gateway, the engine server) reads a body with
`parse_body`: JSON, then the body's nesting (an iterative walk, before pydantic or any recursive
code sees it), then the request model (400 naming the field), then `check_limits`: the sizes and
counts RequestLimits bounds (common/request_limits.py), each a 400 naming the field and the limit.

Fields the model does not know are dropped and named: vLLM's choice (accept, warn), made visible
to the client in the `X-Kvharbor-Ignored-Fields` header, and counted and logged by the server. A
typo like `temprature` is seen, and an engine behind the gateway never receives a field nobody
validated (vLLM-only fields included).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from kvharbor.common.openai_api import APIError, ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvharbor.common.request_limits import RequestLimits, json_depth

IGNORED_HEADER = "X-Kvharbor-Ignored-Fields"
log = logging.getLogger("kvharbor.request_body")


@dataclass(frozen=True)
class Parsed:
    """A request read at the edge: the validated model, the raw JSON (less the ignored fields),
    and the top-level fields it carried that no model field takes."""

    body: Any
    raw: dict
    ignored: tuple[str, ...]

    def headers(self) -> dict[str, str]:
        """The response headers that tell the client what was ignored (names JSON-escaped to
        printable ASCII: a header carries no other bytes)."""
        if not self.ignored:
            return {}
        return {IGNORED_HEADER: ", ".join(json.dumps(name)[1:-1] for name in self.ignored)[:512]}


async def read_body(request: Any, model_cls: type[BaseModel], limits: RequestLimits, ignored: Any) -> Parsed:
    """`parse_body` of a Starlette request's body; the fields it ignored are counted in the
    `ignored` counter (a prometheus Counter) and logged."""
    parsed = parse_body(await request.body(), model_cls, limits)
    if parsed.ignored:
        ignored.inc(len(parsed.ignored))
        log.warning("request fields ignored", extra={"fields": ", ".join(parsed.ignored)[:300]})
    return parsed


def parse_body(data: bytes, model_cls: type[BaseModel], limits: RequestLimits) -> Parsed:
    """Read one request body. Raises APIError (400, naming the field) for what cannot be served."""
    try:
        raw = json.loads(data)
    except RecursionError:  # nested past what the decoder takes: name the field that does it
        field = deepest_field(data, limits.max_body_depth)
        raise APIError(400, f"{field}: nests deeper than this server accepts ({limits.max_body_depth} levels)",
                       param=field, code="too_deep") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    return parse_raw(raw, model_cls, limits)


def parse_raw(raw: Any, model_cls: type[BaseModel], limits: RequestLimits) -> Parsed:
    """`parse_body` of an already decoded body (the gateway's translation of a Responses request)."""
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_depth(raw, limits.max_body_depth)
    try:
        body = model_cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        where = where or getattr(first.get("ctx", {}).get("error"), "field", "")  # a model's own check (FieldError)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        raise APIError(400, message, param=where or None) from None
    ignored = tuple(sorted(set(raw) - known_fields(model_cls)))
    if isinstance(body, ChatCompletionRequest | CompletionRequest):
        check_limits(body, limits)
    if isinstance(body, EmbeddingRequest):
        _at_most("input", len(body.inputs()), limits.max_prompts, "max_prompts", "inputs")
    return Parsed(body, {k: v for k, v in raw.items() if k not in ignored}, ignored)


def deepest_field(data: bytes, limit: int) -> str | None:
    """The top-level key of a JSON object text under which the nesting first passes `limit`
    levels (the object is level 1); None if none does. A scan of the text for bodies too deep to
    decode: brackets inside strings do not count."""
    text = data.decode("utf-8", errors="replace")
    depth, key, i, n = 0, None, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            end = i + 1
            while end < n and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            if depth == 1:
                key = text[i + 1 : end]
            i = end + 1
            continue
        if c in "[{":
            depth += 1
            if depth > limit:
                return key
        elif c in "]}":
            depth -= 1
        i += 1
    return None


def known_fields(model_cls: type[BaseModel]) -> set[str]:
    """The top-level names `model_cls` reads (field names and their aliases)."""
    return {name for field_name, f in model_cls.model_fields.items() for name in (field_name, f.alias) if name}


def check_depth(raw: dict, limit: int) -> None:
    """400 naming the top-level field whose value nests deeper than `limit` levels (the body is
    level 1). Iterative: a body of 10^6 brackets costs a walk, never the stack."""
    for key, value in raw.items():
        if json_depth(value, limit) >= limit:
            raise APIError(
                400, f"{key}: nests deeper than this server accepts ({limit} levels in a body; a JSON schema at most "
                "structured_max_depth)", param=key, code="too_deep",
            )  # fmt: skip


def check_limits(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """The sizes and counts of a validated request (400 naming the field and the limit)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    _at_most("n", body.n, limits.max_n, "max_n")
    if isinstance(body, CompletionRequest):
        _at_most("best_of", body.best_of or 1, limits.max_n, "max_n")
        _at_most("prompt", len(body.prompts()), limits.max_prompts, "max_prompts", "prompts")
    _at_most("stop", len(stops), limits.max_stop_strings, "max_stop_strings", "stop strings")
    _at_most("stop", max(map(len, stops), default=0), limits.max_stop_length, "max_stop_length", "characters")
    _at_most("stop_token_ids", len(body.stop_token_ids or ()), limits.max_stop_token_ids, "max_stop_token_ids", "ids")
    _at_most("logit_bias", len(body.logit_bias or {}), limits.max_logit_bias, "max_logit_bias", "entries")
    if isinstance(body, ChatCompletionRequest):
        _at_most("tools", len(body.tools or ()), limits.max_tools, "max_tools", "tools")
        for i, tool in enumerate(body.tools or ()):
            _check_spec(f"tools.{i}.function.parameters", "json", tool.function.parameters, limits)
    field = body.constraint_field() or "tool_choice"
    spec = body.sampling_kwargs()["structured"]
    if spec is not None:
        _check_spec(field, spec["kind"], spec["value"], limits)


def _at_most(param: str, value: int, limit: int, name: str, unit: str = "") -> None:
    if value > limit:
        what = f"{value} {unit}".strip()
        raise APIError(400, f"{param}: {what} is over this server's limit of {limit} ({name})", param=param,
                       code="over_limit")  # fmt: skip


def _check_spec(param: str, kind: str, value: Any, limits: RequestLimits) -> None:
    """A structured-output spec's size and (a schema's) nesting, before anything compiles it."""
    size = len(json.dumps(value)) if kind in ("json", "choice") else len(str(value))
    _at_most(param, size, limits.structured_max_bytes, "structured_max_bytes", "bytes")
    if kind == "json":
        depth = json_depth(value, limits.structured_max_depth + 1)
        _at_most(param, depth, limits.structured_max_depth, "structured_max_depth", "levels of nesting")


def document_bodies(app: Any, bodies: dict[str, type[BaseModel]], bearer: bool = False) -> None:
    """Bodies read by `parse_body` are not FastAPI parameters: put their schemas into the app's
    OpenAPI document by hand, so clients and fuzzers see what each endpoint takes. `bearer`: the
    endpoints take an API key."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = default()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        if bearer:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
