"""FieldError: a request model's own check (a pydantic model validator) that names the field at
fault, so the 400 it becomes carries that field as `param` (common/request_body.py) even though a
model-level check has no location of its own."""

from __future__ import annotations


class FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
