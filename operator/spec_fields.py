"""Checks of an InferenceService spec's fields that several sections share (roles, adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def whole_number(value: Any, where: str, lowest: int, highest: int) -> int:
    """`value` if it is an int in lowest..highest; ValueError naming the field otherwise."""
    # NOTE: bool is an int in Python; `replicas: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= highest:
        raise ValueError(f"{where} must be a whole number in {lowest}..{highest}, got {value!r}")
    return value


def known_fields(section: Mapping[str, Any], known: set[str], where: str) -> None:
    """ValueError naming the fields of `section` outside `known` (a typo is not ignored)."""
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
