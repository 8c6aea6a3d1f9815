"""The handles of P/D hand-off leases (engine/kv_handoff.py): the prefill request's id and an HMAC
of it under a secret the core process draws at start and tells only its own API server.

A request id alone is no capability: clients may choose it (X-Request-Id), logs show it, and a
lease's blocks are the tenant's prompt in KV form. So the hand-off port serves a lease only to its
signed handle, and logs name the request id, never the handle. Torch-free: the API server signs.
"""

from __future__ import annotations

import hashlib
import hmac

MAC_HEX = 32  # 128 bits of HMAC-SHA256


def sign_handle(secret: bytes, request_id: str) -> str:
    """The hand-off handle of `request_id`'s lease: what the prefill's answer gives the decode side."""
    return f"{request_id}.{_mac(secret, request_id)}"


def handle_request_id(secret: bytes, handle: str) -> str | None:
    """The request id a handle signs, or None when it is not one `sign_handle` made with `secret`."""
    request_id, dot, mac = handle.rpartition(".")
    if not dot or not hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), _mac(secret, request_id).encode()):
        return None
    return request_id


def unverified_request_id(handle: str) -> str:
    """The request id a handle names, unchecked: what the decode side's logs and errors show."""
    return handle.rpartition(".")[0] or "?"


def _mac(secret: bytes, request_id: str) -> str:
    return hmac.new(secret, request_id.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:MAC_HEX]
