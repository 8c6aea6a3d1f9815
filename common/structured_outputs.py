"""Structured outputs on the wire: OpenAI's `response_format`, and vLLM's `structured_outputs`
extra (with its older `guided_*` spellings), validated in shape here and turned into one spec the
engine compiles: {"kind": "json" | "regex" | "choice" | "grammar", "value": ...}.

A request carries one constraint at most. Whether a schema, regex or grammar compiles is the
engine's to say (engine/structured/): it answers 400 with the compiler's reason.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvharbor.common.field_error import FieldError

# What a bare `{"type": "json_object"}` allows: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class JSONSchemaFormat(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=lambda: dict(ANY_OBJECT))
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self

    def spec(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"kind": "json", "value": dict(ANY_OBJECT)}
        schema = self.json_schema.schema_
        return {"kind": "json", "value": closed_objects(schema) if self.json_schema.strict else schema}


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema, or its JSON text), regex, choice
    or grammar (Lark, or EBNF/GBNF with `::=`)."""

    model_config = ConfigDict(extra="forbid")

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice or grammar")
        return self

    def spec(self) -> dict[str, Any]:
        if self.json_ is not None:
            return {"kind": "json", "value": _schema(self.json_, "structured_outputs.json")}
        if self.regex is not None:
            return {"kind": "regex", "value": self.regex}
        if self.choice is not None:
            return {"kind": "choice", "value": list(self.choice)}
        return {"kind": "grammar", "value": self.grammar}


class StructuredFields(BaseModel):
    """The request fields that constrain the output (mixed into chat and completions)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for the same, still sent by many clients
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredFields:
        if len(self._constraints()) > 1:
            raise FieldError(
                self.constraint_field() or "response_format",
                "send one output constraint: response_format, structured_outputs or one guided_* field",
            )
        try:
            self.structured_spec()  # a schema sent as JSON text must parse: a 400 here, not in the engine
        except FieldError:
            raise
        except ValueError as exc:
            raise FieldError(self.constraint_field() or "structured_outputs", str(exc)) from None
        return self

    def _constraints(self) -> list[Any]:
        given = [self.structured_outputs, self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar]
        if self.response_format is not None and self.response_format.type != "text":
            given.append(self.response_format)
        return [g for g in given if g is not None]

    def constraint_field(self) -> str | None:
        """The request field that carries its constraint (an error names it as `param`)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        names = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return next((name for name in names if getattr(self, name) is not None), None)

    def structured_spec(self) -> dict[str, Any] | None:
        """The engine's spec of the request's constraint, or None for free text. Raises ValueError
        for a json given as text that is not a JSON object."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.spec()
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        return StructuredOutputs.model_validate(guided).spec() if guided else None


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its properties and
    says nothing of others: OpenAI's strict mode. Without it a small model fills a tool call's
    arguments with keys of its own invention until max_tokens cuts it."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(value: dict[str, Any] | str, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    return schema
