"""Is a request body valid Unicode text? Bytes that are not UTF-8, and JSON `\\uD800`-`\\uDFFF`
escapes that do not pair up (lone UTF-16 surrogates), decode to no text at all: Python's json
module accepts the escapes, and the tokenizer, the logs or the reply then fail (a 500). Every
HTTP surface checks bodies here first and answers 400 (common/http_errors.py BodyGuardMiddleware).
"""

from __future__ import annotations

import json
import re

# A surrogate escape anywhere: the cheap test that lets almost every body skip the exact one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def unicode_problem(body: bytes) -> tuple[str, str | None] | None:
    """None when `body` is valid UTF-8 and (as JSON) holds only valid strings; else a message
    saying what and where, and the JSON path of the bad string (None when not JSON-located)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the request body is not valid UTF-8 (at byte {exc.start}): send UTF-8 text", None
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None  # not JSON: the app's parser answers that
    path = lone_surrogate_path(doc)
    if path is None:
        return None
    return (
        f"{path or 'the body'} holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
        "which is not Unicode text: send valid UTF-8, or pair the surrogates",
        path or None,
    )


def lone_surrogate_path(doc: object) -> str | None:
    """The path (e.g. `messages.0.content`) of the first string or key in `doc` that cannot be
    encoded as UTF-8; None if there is none. Iterative: deep nesting cannot overflow the stack."""
    stack: list[tuple[object, str]] = [(doc, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not _encodes(node):
                return path
        elif isinstance(node, dict):
            for key, value in node.items():
                where = f"{path}.{key}" if path else str(key)
                if not _encodes(key):
                    return path or "a key"
                stack.append((value, where))
        elif isinstance(node, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(node))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
