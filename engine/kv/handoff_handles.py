"""The handles of P/D hand-off leases (engine/kv/kv_handoff.py): the lease's key (the prefill
request's id and a nonce the API server draws for that one prefill) and an HMAC of it under a
secret the core process draws at start and tells only its own API server.

A request id alone is no capability: clients may choose it (X-Request-Id), logs show it, and a
lease's blocks are the tenant's prompt in KV form. So the hand-off port serves a lease only to its
signed handle, and logs name the request id, never the handle. The nonce makes a handle name one
lease: a request id may come again (a client's retry), and a handle of an earlier prefill must not
open a later one's KV. Torch-free: the API server signs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

MAC_HEX = 32  # 128 bits of HMAC-SHA256
NONCE_HEX = 16  # 64 bits: tells apart the leases of one request id, not a secret


def new_lease_key(request_id: str) -> str:
    """The key a prefill's hand-off lease is held under: its request id and a fresh nonce."""
    return f"{request_id}#{secrets.token_hex(NONCE_HEX // 2)}"


def sign_handle(secret: bytes, lease: str) -> str:
    """The hand-off handle of the lease held under `lease`: what the prefill's answer gives the
    decode side."""
    return f"{lease}.{_mac(secret, lease)}"


def handle_lease(secret: bytes, handle: str) -> str | None:
    """The lease key a handle signs, or None when it is not one `sign_handle` made with `secret`."""
    lease, dot, mac = handle.rpartition(".")
    if not dot or not hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), _mac(secret, lease).encode()):
        return None
    return lease


def unverified_request_id(handle: str) -> str:
    """The request id a handle names, unchecked: what the decode side's logs and errors show."""
    lease = handle.rpartition(".")[0]
    return lease.rpartition("#")[0] or lease or "?"


def _mac(secret: bytes, lease: str) -> str:
    return hmac.new(secret, lease.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:MAC_HEX]
