"""The load test's tenants: the contract between `kvharbor up --loadtest-tenants` (which loads
them, so that `make up` then `make loadtest HOST=...` works) and loadtest/ (which sends their keys).

The keys are public on purpose, like a test fixture's: load them only into a platform on your own
machine, never into one that others can reach.
"""

from __future__ import annotations

from kvharbor.common.api_keys import hash_key

# name -> (API key, priority); a priority below 0 may be shed.
LOADTEST_TENANTS = {
    "chat": ("sk-load-chat", 0),
    "docqa": ("sk-load-docqa", 0),
    "batch": ("sk-load-batch", -1),
}


def loadtest_tenant_rows() -> list[dict]:
    """The tenants-file rows for these personas (keys hashed, as the gateway wants them)."""
    return [
        {"name": name, "api_keys": [hash_key(key)], "priority": priority, "models": ["*"]}
        for name, (key, priority) in LOADTEST_TENANTS.items()
    ]
