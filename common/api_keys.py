"""How API keys are stored: tenants files, the gateway's Secret and `kvharbor up` keep only this
digest of a key, never the key itself."""

from __future__ import annotations

import hashlib


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
