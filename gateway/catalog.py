"""What a tenant may name in a request's `model` field: the configured base models, and the LoRA
adapters their engines serve (vLLM's convention: an adapter is asked for by its own name).

- A configured model's name resolves to that model, as before (403 if the tenant may not use it).
- Any other name is an adapter when some routable engine of a base model the tenant may use
  reports it (`lora_adapters` in /load) and the tenant is granted it (`adapters:` in the tenants
  file). The request then runs on that base model (its tokenizer, SLOs and KV index), on those of
  its engines that report the adapter, hashed under the adapter's identity.
- Everything else is 404 `model_not_found`, worded the same whether the name exists nowhere or
  is an adapter the tenant was not granted: a tenant cannot learn that another's adapter is there.
- A configured model's name always means the model, even if an engine reports an adapter of that
  name; an adapter reported under two base models resolves to the first base by name.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvharbor.common.openai_api import APIError
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.tenants import Tenant

EnginesByModel = Mapping[str, Sequence[Engine]]  # each configured model -> its routable engines


@dataclass(frozen=True)
class Resolved:
    """A request's `model`, resolved."""

    base: str  # the configured model it runs on
    adapter: str | None = None  # its LoRA adapter's name; None: the base model itself
    identity: str | None = None  # that adapter's identity (common/lora.py), for the block hashes


def adapter_engines(engines: Sequence[Engine], adapter: str | None) -> list[Engine]:
    """The engines that can serve `adapter` (all of them for the base model)."""
    return list(engines) if adapter is None else [e for e in engines if e.serves_adapter(adapter)]


def handoff_peers(engines: Sequence[Engine], decode: Engine, adapter: str | None) -> list[Engine]:
    """The engines whose KV `decode` may continue (P/D hand-offs): those whose blocks it can read
    (the same /load kv_format: layout, KV dtype and weights; it refuses others' and recomputes),
    and for an adapter only those that serve it with the decode engine's identity, since a
    hand-off is KV computed under its weights."""
    readable = [e for e in engines if e.load.kv_format == decode.load.kv_format]
    if adapter is None:
        return readable
    identity = decode.load.lora_adapters.get(adapter)
    return [e for e in readable if identity is not None and e.load.lora_adapters.get(adapter) == identity]


def adapter_identity_of(engines: Sequence[Engine], adapter: str) -> str | None:
    """The identity the engines report for `adapter`: the most common one (engines that report
    another, in a rolling update of its weights, publish other hashes and simply miss)."""
    seen = collections.Counter(e.load.lora_adapters[adapter] for e in engines if e.serves_adapter(adapter))
    return min(seen, key=lambda i: (-seen[i], i)) if seen else None


def granted_adapters(tenant: Tenant, engines_by_model: EnginesByModel) -> dict[str, str]:
    """Adapter name -> its base model, for every adapter `tenant` may ask for now."""
    found: dict[str, str] = {}
    for base in sorted(engines_by_model):
        if not tenant.may_use(base):
            continue
        for engine in engines_by_model[base]:
            for name in engine.load.lora_adapters:
                if name not in engines_by_model and tenant.may_use_adapter(name):
                    found.setdefault(name, base)
    return found


def listed_models(tenant: Tenant, engines_by_model: EnginesByModel) -> list[dict]:
    """`/v1/models` for `tenant`: the base models it may use, then its adapters with their `parent`."""
    bases = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvharbor", "parent": None}
        for m in sorted(engines_by_model)
        if tenant.may_use(m)
    ]
    adapters = [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvharbor", "parent": base}
        for name, base in sorted(granted_adapters(tenant, engines_by_model).items())
    ]
    return bases + adapters


def resolve(name: str, tenant: Tenant, engines_by_model: EnginesByModel) -> Resolved:
    """The base model and adapter a request's `model` names. Raises APIError: 404
    `model_not_found` (an unknown name, or an adapter not granted or not on a model the tenant may
    use), 403 `model_not_allowed` (a configured model the tenant may not use)."""
    if name in engines_by_model:
        if not tenant.may_use(name):
            raise APIError(
                403,
                f"tenant {tenant.name!r} may not use model {name!r}",
                type="permission_error",
                param="model",
                code="model_not_allowed",
            )
        return Resolved(name)
    base = granted_adapters(tenant, engines_by_model).get(name)
    if base is None:
        known = ", ".join(m["id"] for m in listed_models(tenant, engines_by_model)) or "none"
        raise APIError(
            404,
            f"model {name!r} does not exist; models you may use: {known}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    return Resolved(base, name, adapter_identity_of(engines_by_model[base], name))
