"""What each kind of engine behind the gateway is, and can do: chosen once per engine (its address
says its kind: gateway/engines.py `parse_engine`), then asked, never compared by name. A third
kind (SGLang, say) is one more object here.

    kvharbor   `kvharbor serve`: /load, steps counted (a stall shows), streams that continue on
               another engine, P/D hand-offs, its task in /load, kvharbor's request fields
    vllm       a vLLM server: its /metrics (and /v1/models) as the load, bodies as vLLM reads them
               (engine_body.vllm_body), priority only where it runs --scheduling-policy priority
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvharbor.common.load_report import LoadReport
from kvharbor.common.vllm_metrics import load_from_vllm_metrics, with_vllm_adapters
from kvharbor.gateway.engine_body import vllm_body

if TYPE_CHECKING:
    from kvharbor.gateway.engines import Engine


@dataclass(frozen=True)
class EngineKind:
    name: str
    names_instance: bool  # its address names the instance id its KV events carry (it says none itself)
    counts_steps: bool  # its load report counts core steps: steps standing still with work is a stall
    continues_streams: bool  # a broken stream continues on it from the token ids streamed (migration)
    takes_handoffs: bool  # P/D: prefills and their continuations (kv_transfer_params as kvharbor reads them)
    reports_task: bool  # its load says whether it generates or embeds
    takes_kvharbor_fields: bool  # cache_salt, priority and request_id as kvharbor engines read them
    priority_by_flag: bool  # it ranks by priority only when started so (--vllm-priority says it is)

    async def read_load(self, client: Any, engine: Engine, timeout: float) -> LoadReport:
        resp = await client.get(engine.url + "/load", timeout=timeout)
        resp.raise_for_status()
        return LoadReport.from_json(resp.json())

    def shape(self, call: Any, body: dict, engine: Engine) -> dict:
        """The body the gateway built for this kind of engine: as it is."""
        return body

    def serves_embeddings(self, engine: Engine, model_task: str) -> bool:
        """Its load says its task; else its model's (the models file's `task`)."""
        return engine.load.task == "embed" if self.reports_task else model_task == "embed"


class _VllmKind(EngineKind):
    async def read_load(self, client: Any, engine: Engine, timeout: float) -> LoadReport:
        """Its /metrics mapped onto a LoadReport; /metrics names only the adapters running or
        waiting, /v1/models every loaded one."""
        resp = await client.get(engine.url + "/metrics", timeout=timeout)
        resp.raise_for_status()
        load = load_from_vllm_metrics(resp.text, engine.instance_id or engine.url)
        models = await client.get(engine.url + "/v1/models", timeout=timeout)
        models.raise_for_status()
        return with_vllm_adapters(load, models.json())

    def shape(self, call: Any, body: dict, engine: Engine) -> dict:
        return vllm_body(call, body, engine.priority_scheduling)


KVHARBOR = EngineKind("kvharbor", names_instance=False, counts_steps=True, continues_streams=True, takes_handoffs=True,
                      reports_task=True, takes_kvharbor_fields=True, priority_by_flag=False)  # fmt: skip
VLLM = _VllmKind("vllm", names_instance=True, counts_steps=False, continues_streams=False, takes_handoffs=False,
                 reports_task=False, takes_kvharbor_fields=False, priority_by_flag=True)  # fmt: skip
KINDS = {kind.name: kind for kind in (KVHARBOR, VLLM)}


def engine_kind(name: str) -> EngineKind:
    """The kind of that name; ValueError naming the kinds there are."""
    if name not in KINDS:
        raise ValueError(f"engine kind {name!r} is not one of {', '.join(KINDS)}")
    return KINDS[name]
