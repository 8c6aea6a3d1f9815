"""LoRA adapters in the operator (issue 18, operator/adapters.py): spec.adapters and spec.lora
become the engine config's `lora` list and limits and read-only mounts in every role's pods;
placement counts the adapters' memory; status.adapters comes from the engines' /load; a Tenant's
spec.adapters goes into the gateway's tenants file. Bad specs are refused with the field named."""

from __future__ import annotations

import asyncio
import base64
import copy
import json

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_operator_manifests import L4, VERSIONS, by_name, example, spec_schema

from kvharbor.common.kube import path
from kvharbor.common.load_report import LoadReport
from kvharbor.operator.adapters import LoraSpec, adapters_status, lora_spec
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.model_profiles import KNOWN, ModelProfile, profile_for
from kvharbor.operator.objects import desired_objects
from kvharbor.operator.placement import EngineShape, PlacementPlan, place
from kvharbor.operator.reconcile import OperatorContext, Resource, engine_shape, observe_service, reconcile_service
from kvharbor.operator.roles import role_specs
from kvharbor.operator.tenants import TenantError, gateway_tenant

MiB = 1 << 20
LLAMA = KNOWN["Llama-3.1-8B-Instruct"]
SMOL = KNOWN["SmolLM2-135M-Instruct"]


def lora_example() -> dict:
    return example("inferenceservice-lora")


def placed_objects(spec: dict, name: str = "llama-8b-lora") -> list[dict]:
    """desired_objects as reconcile makes them: each role placed with the adapters counted."""
    res = Resource(name, "inference", "uid-1", 1, spec, {})
    shape = engine_shape(res)
    plans = {r.role: place(profile_for(spec["model"]["name"]), shape, [L4]) for r in role_specs(spec)}
    return desired_objects(name, "inference", "uid-1", spec, plans, 1, "kvharbor/engine:0.1.0", "redis://r:6379/0")


def pod_of(objs: list[dict], deployment: str) -> dict:
    return by_name(objs)["Deployment", deployment]["spec"]["template"]["spec"]


# --- spec -> engine config and mounts ---------------------------------------------------------


def test_each_source_kind_becomes_a_folder_the_engine_loads():
    objs = placed_objects(lora_example()["spec"])
    config = yaml.safe_load(by_name(objs)["ConfigMap", "llama-8b-lora-engine-config"]["data"]["engine.yaml"])
    assert config["lora"] == [
        "sql=/var/lib/kvharbor/adapters/sql",
        "support-chat=/var/lib/kvharbor/adapters/support-chat",
        "summarize=/models/adapters/summarize",  # a path is used where it is: nothing to mount
    ]
    assert (config["max_loras"], config["max_lora_rank"], config["max_cpu_loras"]) == (2, 16, 4)
    pod = pod_of(objs, "llama-8b-lora-engine")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    sql, chat = mounts["/var/lib/kvharbor/adapters/sql"], mounts["/var/lib/kvharbor/adapters/support-chat"]
    assert volumes[sql["name"]]["configMap"] == {
        "name": "sql-adapter",
        "items": [{"key": "adapter_config.json", "path": "adapter_config.json"},
                  {"key": "adapter_model.safetensors", "path": "adapter_model.safetensors"}],
    }  # fmt: skip
    assert volumes[chat["name"]]["persistentVolumeClaim"] == {"claimName": "lora-adapters", "readOnly": True}
    assert chat["subPath"] == "support-chat" and "subPath" not in sql
    assert all(m["readOnly"] for m in mounts.values())
    assert len(pod["volumes"]) == 3 and len(mounts) == 3  # the engine config, and the two mounted adapters
    for obj in objs:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_adapters_on_one_claim_share_a_volume_and_every_role_mounts_them():
    spec = copy.deepcopy(example("inferenceservice-disaggregated")["spec"])
    spec["adapters"] = [
        {"name": "a", "source": {"pvc": {"claimName": "loras", "subPath": "a/"}}},
        {"name": "b", "source": {"pvc": {"claimName": "loras", "subPath": "./b"}}},
    ]
    objs = placed_objects(spec, "qwen-7b-pd")
    for role in ("prefill", "decode"):
        pod = pod_of(objs, f"qwen-7b-pd-engine-{role}")
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert len(claims) == 1  # one volume per claim, a mount per adapter
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == claims[0]["name"]]
        assert [(m["mountPath"], m["subPath"]) for m in mounts] == [
            ("/var/lib/kvharbor/adapters/a", "a"), ("/var/lib/kvharbor/adapters/b", "b")]  # fmt: skip
        config = yaml.safe_load(by_name(objs)["ConfigMap", f"qwen-7b-pd-engine-{role}-config"]["data"]["engine.yaml"])
        assert config["role"] == role and config["lora"] == ["a=/var/lib/kvharbor/adapters/a",
                                                             "b=/var/lib/kvharbor/adapters/b"]  # fmt: skip
        # Not given: the engine's defaults, and max_cpu_loras written so placement counts what it holds.
        assert (config["max_loras"], config["max_lora_rank"], config["max_cpu_loras"]) == (4, 16, 8)


def test_a_service_without_adapters_keeps_its_engine_config_and_rollout():
    objs = placed_objects(example("inferenceservice")["spec"], "x")
    config = yaml.safe_load(by_name(objs)["ConfigMap", "x-engine-config"]["data"]["engine.yaml"])
    assert not {"lora", "max_loras", "max_lora_rank", "max_cpu_loras"} & set(config)
    deployment = by_name(objs)["Deployment", "x-engine"]["spec"]["template"]
    assert [v["name"] for v in deployment["spec"]["volumes"]] == ["config"]
    # The hash this pod template had before issue 18 (computed with that code): no rollout on
    # upgrade for the adapters. (Issue 20's engine admin_port changed it once, on purpose: a new
    # container port and scrape annotations roll every engine anyway.)
    spec = example("inferenceservice")["spec"]
    model = spec["model"]
    plan = place(LLAMA, EngineShape(model["dtype"], model["maxModelLen"], spec["engine"]["maxNumSeqs"]), [L4])
    (dep,) = [o for o in desired_objects("x", "ns", "u", spec, plan, 1, "img", "redis://r:6379/0")
              if o["kind"] == "Deployment"]  # fmt: skip
    assert dep["spec"]["template"]["metadata"]["annotations"]["kvharbor.io/rollout-hash"] == "c8b1e1ba0aecfd17"


def test_an_adapter_change_rolls_the_engines():
    spec = lora_example()["spec"]
    changed = copy.deepcopy(spec)
    changed["adapters"][0]["source"] = {"configMap": "sql-adapter-v2"}  # new weights: a new ConfigMap
    renamed = copy.deepcopy(spec)
    renamed["adapters"][2]["name"] = "summary"
    key = "kvharbor.io/rollout-hash"
    old, new, other = (by_name(placed_objects(s))["Deployment", "llama-8b-lora-engine"]["spec"]["template"]
                       for s in (spec, changed, renamed))  # fmt: skip
    # Another source changes the pod template itself (its volumes), which rolls the Deployment; the
    # engine config (in the rollout hash) is the same, since the mount path is the adapter's name.
    assert old["spec"]["volumes"] != new["spec"]["volumes"]
    assert old["metadata"]["annotations"][key] != other["metadata"]["annotations"][key]  # the config changed


MODEL = {"source": "/m", "name": "Llama-3.1-8B-Instruct"}


def _with(adapters=None, lora=None) -> dict:
    spec = {"model": MODEL}
    if adapters is not None:
        spec["adapters"] = adapters
    if lora is not None:
        spec["lora"] = lora
    return spec


SQL = {"name": "sql", "source": {"configMap": "sql"}}
THREE = [{"name": n, "source": {"path": f"/a/{n}"}} for n in "abc"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (_with({"sql": {"path": "/a"}}), "adapters must be a list"),
        (_with([SQL, {"name": "sql", "source": {"path": "/a"}}]), r"adapters\[1\].name 'sql' appears twice"),
        (_with([{"name": "my adapter", "source": {"path": "/a"}}]), r"adapters\[0\].name: adapter name 'my adapter'"),
        (_with([{"name": "-x", "source": {"path": "/a"}}]), "starting with a letter or digit"),
        (_with([{"name": "Llama-3.1-8B-Instruct", "source": {"path": "/a"}}]), "is the base model's name"),
        (_with([{"name": "sql"}]), r"adapters\[0\] \(sql\).source needs exactly one of path, configMap or pvc"),
        (_with([{"name": "sql", "source": {"path": "/a", "configMap": "b"}}]), "exactly one of"),
        (_with([{"name": "sql", "source": {"s3": "bucket/sql"}}]), r"got \['s3'\]"),
        (_with([{"name": "sql", "source": {"path": "adapters/sql"}}]), "source.path must be an absolute folder"),
        (_with([{"name": "sql", "source": {"configMap": "SQL_adapter"}}]), "source.configMap must name an object"),
        (_with([{"name": "sql", "source": {"pvc": "loras"}}]), "source.pvc must be an object with claimName"),
        (_with([{"name": "sql", "source": {"pvc": {"subPath": "sql"}}}]), "source.pvc.claimName must name"),
        (_with([{"name": "sql", "source": {"pvc": {"claimName": "l", "subPath": "../x"}}}]), "without '..'"),
        (_with([{"name": "sql", "source": {"pvc": {"claimName": "l", "subPath": "/x"}}}]), "must be a relative"),
        (_with([{"name": "sql", "source": {"pvc": {"claimName": "l", "path": "x"}}}]), "pvc has unknown field"),
        (_with([{**SQL, "rank": 8}]), r"adapters\[0\] has unknown field\(s\) rank; known: name, source"),
        (_with([SQL], {"maxLoras": 0}), r"lora.maxLoras must be a whole number in 1..64, got 0"),
        (_with([SQL], {"maxLoras": True}), "got True"),
        (_with([SQL], {"maxLoraRank": "16"}), r"lora.maxLoraRank must be a whole number in 1..512, got '16'"),
        (_with([SQL], {"maxLoraRank": 1024}), r"1..512, got 1024"),
        (_with([SQL], {"maxLoras": 4, "maxCpuLoras": 2}), r"lora.maxCpuLoras \(2\) is below lora.maxLoras \(4\)"),
        (_with(THREE, {"maxLoras": 1, "maxCpuLoras": 2}), r"lora.maxCpuLoras \(2\) is below the 3 adapters"),
        (_with([SQL], {"maxLora": 4}), "lora has unknown field"),
        (_with([SQL] * 65), "at most 64"),
    ],
)
def test_a_bad_adapter_spec_is_refused_with_the_field_named(spec, message):
    with pytest.raises(ValueError, match=message):
        lora_spec(spec)


def test_the_operator_deploys_nothing_for_a_bad_adapter_spec_and_says_why():
    spec = _with([SQL, {"name": "sql", "source": {"path": "/a"}}])
    body = {"metadata": {"name": "lora", "namespace": "ns", "uid": "u"}, "spec": spec}
    # Refused before the cluster is read: no API client is needed.
    outcome = asyncio.run(reconcile_service(OperatorContext(OperatorConfig(), None, None), body))
    placed = next(c for c in outcome.status["conditions"] if c["type"] == "Placed")
    assert (placed["status"], placed["reason"]) == ("False", "InvalidSpec")
    assert placed["message"] == "invalid spec: adapters[1].name 'sql' appears twice: adapter names must be unique"
    assert outcome.status["phase"] == "Unplaceable"
    assert any(e.type == "Warning" and e.reason == "InvalidSpec" for e in outcome.events)


def test_adapters_of_a_model_without_their_dimensions_are_an_invalid_spec():
    model = {"source": "/m", "name": "mine",
             "profile": {"parameters": 10**9, "layers": 16, "kvHeads": 8, "headDim": 64}}  # fmt: skip
    body = {"metadata": {"name": "lora", "namespace": "ns", "uid": "u"}, "spec": {"model": model, "adapters": [SQL]}}
    outcome = asyncio.run(reconcile_service(OperatorContext(OperatorConfig(), None, None), body))
    placed = next(c for c in outcome.status["conditions"] if c["type"] == "Placed")
    assert placed["reason"] == "InvalidSpec" and "hiddenSize, intermediateSize and attentionHeads" in placed["message"]
    model["profile"] |= {"hiddenSize": 2048, "intermediateSize": 8192, "attentionHeads": 32}
    profile = profile_for("mine", model["profile"])
    assert profile.lora_parameters_per_rank() == (7 * 2048 + 2 * 2048 + 2 * 512 + 3 * 8192) * 16


# --- placement --------------------------------------------------------------------------------


def test_lora_is_sized_as_the_engine_reserves_it():
    # Llama-3.1-8B: q 4096+4096, k and v 4096+1024, o 4096+4096, gate and up 4096+14336, down
    # 14336+4096 = 81920 parameters per layer and unit of rank, x 32 layers.
    assert LLAMA.lora_parameters_per_rank() == 81920 * 32
    # Slots at the model dtype, loaded adapters in float32, all at the max rank: one rank-16 slot
    # in bf16 is 80 MiB, one loaded adapter 160 MiB.
    assert LLAMA.lora_bytes(1, 16, 0, "bfloat16") == 80 * MiB and LLAMA.lora_bytes(0, 16, 1, "bfloat16") == 160 * MiB
    assert LLAMA.lora_bytes(2, 16, 4, "bfloat16") == 800 * MiB  # the LoRA example
    # SmolLM2: (576+576) + 2(576+192) + (576+576) + 2(576+1536) + (1536+576) = 10176 per layer.
    assert SMOL.lora_parameters_per_rank() == 10176 * 30
    assert SMOL.lora_bytes(4, 8, 8, "float32") == 10176 * 30 * 8 * (4 * 4 + 8 * 4)
    with pytest.raises(ValueError, match=r"needs model\.profile\.hiddenSize"):
        ModelProfile("x", 10**9, 16, 8, 64).lora_parameters_per_rank()


def test_the_operator_counts_what_the_engine_reserves():
    """ModelProfile.lora_bytes is the engine's own reservation (engine/lora/lora_manager.py), for a
    model the engine builds from a config.json with the profile's dimensions."""
    from kvharbor.engine.lora.lora_manager import reserved_bytes
    from kvharbor.engine.model.arch import ModelArch

    for profile, vocab in ((SMOL, 49152), (LLAMA, 128256)):
        arch = ModelArch("llama", vocab, profile.hidden_size, profile.intermediate_size, profile.layers,
                         profile.attention_heads, profile.kv_heads, profile.head_dim, 10000.0, 1e-5, 8192, True,
                         False, None, (0,))  # fmt: skip
        assert reserved_bytes(arch, 4, 16, 8, 2) == profile.lora_bytes(4, 16, 8, "bfloat16")
        assert reserved_bytes(arch, 1, 64, 3, 4) == profile.lora_bytes(1, 64, 3, "float32")


def test_placement_counts_the_adapters_an_engine_may_hold():
    # 25 x 8192 tokens of Llama-3.1-8B just fit two L4s, 544 MiB to spare: one slot and one
    # loaded adapter of rank 16 (240 MiB) still do; the engine's defaults (4 slots, 8 loaded:
    # 1.6 GiB) need four L4s.
    plain = place(LLAMA, EngineShape("bfloat16", 8192, 25), [L4])
    small = place(LLAMA, EngineShape("bfloat16", 8192, 25, lora_slots=1, lora_rank=16, lora_loaded=1), [L4])
    default = EngineShape("bfloat16", 8192, 25, lora_slots=4, lora_rank=16, lora_loaded=8)
    big = place(LLAMA, default, [L4])
    assert isinstance(small, PlacementPlan) and isinstance(big, PlacementPlan)
    assert (plain.gpus_per_replica, small.gpus_per_replica, big.gpus_per_replica) == (2, 2, 4)
    assert (plain.adapter_bytes, small.adapter_bytes, big.adapter_bytes) == (0, 240 * MiB, 1600 * MiB)
    # What is left for KV shrinks by the adapters (kvMemoryFraction 1 here).
    assert plain.kv_capacity_tokens - small.kv_capacity_tokens == 240 * MiB // LLAMA.kv_bytes_per_token("bfloat16")
    (reason,) = place(LLAMA, default, [L4], gpus_per_replica=2)
    assert "+ LoRA 1.6 for 4 slots and 8 adapters at rank 16)" in reason


def test_the_engine_shape_is_the_lora_limits_the_engine_gets():
    spec = lora_example()["spec"]  # 3 adapters, maxLoras 2, maxCpuLoras 4
    shape = engine_shape(Resource("x", "ns", "u", 1, spec, {}))
    assert (shape.lora_slots, shape.lora_rank, shape.lora_loaded) == (2, 16, 4)
    del spec["lora"]["maxCpuLoras"]
    assert engine_shape(Resource("x", "ns", "u", 1, spec, {})).lora_loaded == 8  # the engine's default
    many = {"model": MODEL, "adapters": [{"name": f"a{i}", "source": {"path": f"/a/{i}"}} for i in range(12)],
            "lora": {"maxLoras": 16}}  # fmt: skip
    assert lora_spec(many).max_cpu_loras == 16  # at least maxLoras and every adapter: the engine refuses less
    many["lora"] = {}
    assert lora_spec(many).max_cpu_loras == 12
    off = engine_shape(Resource("x", "ns", "u", 1, {"model": MODEL, "lora": {"maxLoras": 8}}, {}))
    assert (off.lora_slots, off.lora_loaded) == (0, 0)  # no adapters: LoRA off, nothing counted


# --- status -----------------------------------------------------------------------------------


def test_status_adapters_counts_the_engines_that_report_each():
    lora = lora_spec(lora_example()["spec"])
    loads = [
        LoadReport(lora_adapters={"sql": "sql@aa", "summarize": "summarize@cc"}),
        LoadReport(lora_adapters={"sql": "sql@bb", "hotfix": "hotfix@dd"}),  # rolling out new sql weights
        LoadReport(),  # an engine with LoRA off
    ]
    assert adapters_status(lora, loads) == [
        {"name": "sql", "engines": 2, "configured": True, "identities": ["sql@aa", "sql@bb"]},
        {"name": "support-chat", "engines": 0, "configured": True},  # no engine serves it (yet)
        {"name": "summarize", "engines": 1, "configured": True, "identities": ["summarize@cc"]},
        {"name": "hotfix", "engines": 1, "configured": False, "identities": ["hotfix@dd"]},  # loaded at run time
    ]
    assert adapters_status(LoraSpec(), [LoadReport()]) == []


class FakeKube:
    """The reads observe_service makes, from a dict of objects by path."""

    def __init__(self, objects: dict[str, dict], slices: list[dict]) -> None:
        self.objects, self.slices = objects, slices

    async def get(self, url: str) -> dict | None:
        return self.objects.get(url)

    async def list(self, url: str, selector: str | None = None) -> list[dict]:
        return self.slices if "endpointslices" in url else []

    async def merge_patch(self, url: str, patch: dict) -> dict:
        raise AssertionError(f"no scaling expected: {url} {patch}")


def _observe(spec: dict, status: dict, reports: dict[str, dict]) -> dict:
    """One observe_service pass over a placed, ready service whose engines answer `reports`."""
    ns, name = "inference", "lora"
    owned = [("Deployment", "apps/v1", "lora-engine"), ("ConfigMap", "v1", "lora-engine-config"),
             ("Service", "v1", "lora"), ("PodDisruptionBudget", "policy/v1", "lora-engine")]  # fmt: skip
    ready = {"spec": {"replicas": 2}, "status": {"readyReplicas": 2, "updatedReplicas": 2}}
    objects = {path(api, kind, ns, obj): ready for kind, api, obj in owned}
    slices = [{"addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
               "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in reports]}]  # fmt: skip

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=reports[request.url.host])

    async def run() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            ctx = OperatorContext(OperatorConfig(), FakeKube(objects, slices), http)
            placed = {"type": "Placed", "status": "True", "reason": "Fits", "message": "", "lastTransitionTime": "x"}
            body = {"metadata": {"name": name, "namespace": ns, "uid": "u"}, "spec": spec,
                    "status": {"conditions": [placed], **status}}  # fmt: skip
            return (await observe_service(ctx, body, now=1000.0)).status

    return asyncio.run(run())


def test_observe_reports_the_adapters_of_the_ready_engines_and_clears_them_once_gone():
    spec = {"model": {"source": "/m", "name": "SmolLM2-135M-Instruct"}, "replicas": {"min": 2, "max": 2},
            "adapters": [{"name": "sql", "source": {"configMap": "sql-adapter"}}]}  # fmt: skip
    reports = {"10.0.0.1": {"lora_adapters": {"sql": "sql@1"}, "lora_slots": 4},
               "10.0.0.2": {"lora_adapters": {}, "lora_slots": 4}}  # fmt: skip
    status = _observe(spec, {}, reports)
    assert status["adapters"] == [{"name": "sql", "engines": 1, "configured": True, "identities": ["sql@1"]}]
    assert json.loads(json.dumps(status))  # what kopf patches: plain JSON
    without = {k: v for k, v in spec.items() if k != "adapters"}
    assert _observe(without, {"adapters": status["adapters"]}, {"10.0.0.1": {}})["adapters"] is None  # removed
    assert "adapters" not in _observe(without, {}, {"10.0.0.1": {}})  # never had any: nothing written


# --- CRDs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("name", "my adapter"),
        ("name", ""),
        ("source", {}),
        ("source", {"path": "/a", "configMap": "b"}),
        ("source", {"s3": "bucket"}),  # not a source kind: strict field validation refuses it
        ("source", {"path": "relative/dir"}),
        ("source", {"configMap": "Upper_Case"}),
        ("source", {"pvc": {"subPath": "x"}}),
        ("source", {"pvc": {"claimName": "c", "subPath": "/abs"}}),
        ("rank", 8),
    ],
)
def test_the_crd_refuses_a_bad_adapter(where, value):
    body = lora_example()
    body["spec"]["adapters"][0][where] = value
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(body, spec_schema("inferenceservices"))
    assert "adapters" in refused.value.absolute_path


@pytest.mark.parametrize(("field", "value"), [("maxLoras", 0), ("maxLoraRank", "16"), ("maxCpuLoras", 2000),
                                              ("slots", 4)])  # fmt: skip
def test_the_crd_refuses_bad_lora_limits(field, value):
    body = lora_example()
    body["spec"]["lora"][field] = value
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(body, spec_schema("inferenceservices"))
    assert "lora" in refused.value.absolute_path


def test_the_crd_keys_adapters_by_name_and_reports_them_in_status():
    schema = spec_schema("inferenceservices")
    adapters = schema["properties"]["spec"]["properties"]["adapters"]
    assert (adapters["x-kubernetes-list-type"], adapters["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    body = lora_example() | {"status": {"adapters": [{"name": "sql", "engines": 2, "configured": True,
                                                      "identities": ["sql@ab"]}],
                                        "placement": {"pool": "l4", "adapterBytes": 4 * 80 * MiB}}}  # fmt: skip
    jsonschema.validate(body, schema)


@pytest.mark.parametrize("adapters", [["bad name"], "sql", [""]])
def test_the_tenant_crd_refuses_bad_adapter_grants(adapters):
    body = example("tenant-lora")
    body["spec"]["adapters"] = adapters
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, spec_schema("tenants"))
    body["spec"]["adapters"] = ["*"]
    jsonschema.validate(body, spec_schema("tenants"))


# --- Tenants ----------------------------------------------------------------------------------

SECRET = {"metadata": {"name": "k"}, "data": {"api-key": base64.b64encode(b"sk-1").decode()}}


def _tenant(**spec) -> dict:
    return {"metadata": {"name": "t"}, "spec": {"apiKeySecretRef": {"name": "k"}, **spec}}


def test_a_tenants_adapters_go_into_its_gateway_entry():
    assert gateway_tenant(example("tenant-lora"), SECRET)["adapters"] == ["sql"]
    assert gateway_tenant(_tenant(adapters=["*"]), SECRET)["adapters"] == ["*"]
    assert gateway_tenant(_tenant(adapters=["sql", "chat", "sql"]), SECRET)["adapters"] == ["chat", "sql"]
    # None granted: no key at all, so the file of a tenant without adapters is as it was.
    assert "adapters" not in gateway_tenant(_tenant(), SECRET)
    assert "adapters" not in gateway_tenant(_tenant(adapters=[]), SECRET)


@pytest.mark.parametrize(
    ("adapters", "message"),
    [(["*", "sql"], r"\['\*'\] alone"), (["bad name"], "spec.adapters: adapter name 'bad name'"), ("sql", "a list")],
)
def test_a_bad_adapter_grant_leaves_the_tenant_out_and_says_why(adapters, message):
    with pytest.raises(TenantError, match=message):
        gateway_tenant(_tenant(adapters=adapters), SECRET)


def test_the_gateway_reads_a_tenant_granted_adapters():
    from kvharbor.gateway.tenants import parse_tenants

    entry = gateway_tenant(example("tenant-lora"), SECRET)
    (tenant,) = parse_tenants({"tenants": [entry]}).values()
    assert "'sql'" in repr(tenant)  # granted, whatever the gateway names the field


def test_the_engine_accepts_the_lora_config_the_operator_gives_it(tmp_path):
    """The LoRA keys of the engine ConfigMap go through `kvharbor serve`'s own parser."""
    from kvharbor.common.config import config_from_argv, leaves
    from kvharbor.engine.config import ServeConfig

    by_leaf = {leaf.name: leaf.path for leaf in leaves(ServeConfig)}
    objs = by_name(placed_objects(lora_example()["spec"]))
    (tmp_path / "engine.yaml").write_text(objs["ConfigMap", "llama-8b-lora-engine-config"]["data"]["engine.yaml"])
    config = config_from_argv(ServeConfig, ["--config", str(tmp_path / "engine.yaml")], "test", "test")

    def value(name: str):
        node = config
        for part in by_leaf[name]:
            node = getattr(node, part)
        return node

    assert [str(spec) for spec in value("lora")] == [
        "sql=/var/lib/kvharbor/adapters/sql",
        "support-chat=/var/lib/kvharbor/adapters/support-chat",
        "summarize=/models/adapters/summarize",
    ]
    assert (value("max_loras"), value("max_lora_rank"), value("max_cpu_loras")) == (2, 16, 4)
