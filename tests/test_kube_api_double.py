"""Tests of the Kubernetes API server test double (tests/kube_api_double.py): plain HTTP with httpx,
the official `kubernetes` client, and the real kopf operator run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from kube_api_double import KubeAPIDouble
from servers import wait_for

CRDS = sorted((Path(__file__).resolve().parents[1] / "charts" / "kvharbor" / "crds").glob("*.yaml"))
CM = "/api/v1/namespaces/default/configmaps"
DEPLOY = "/apis/apps/v1/namespaces/default/deployments"
ISVC = "/apis/kvharbor.io/v1alpha1/namespaces/default/inferenceservices"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}


@pytest.fixture
def double():
    with KubeAPIDouble(CRDS) as api:
        yield api


@pytest.fixture
def client(double):
    with httpx.Client(base_url=double.url, timeout=10) as http:
        yield http


def configmap(name: str, labels: dict | None = None, **extra) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {}},
            "data": {"k": "v"}, **extra}


def deployment(name: str, replicas: int = 1) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "img"}]}}}}


def isvc(name: str) -> dict:
    return {"apiVersion": "kvharbor.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"model": {"source": "/models/m", "name": "m"}}}


def watch(client: httpx.Client, path: str, **params) -> list[dict]:
    """All events of a watch that the server ends after timeoutSeconds (1 s unless given)."""
    params = {"watch": "true", "timeoutSeconds": "1", **params}
    with client.stream("GET", path, params=params) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line]


def summary(events: list[dict]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"].get("metadata", {}).get("name", "")) for e in events]


# --- discovery -----------------------------------------------------------------------------------


def test_discovery_lists_builtins_crds_and_status_subresources(client):
    assert client.get("/version").json()["gitVersion"].startswith("v1.")
    assert client.get("/api").json()["versions"] == ["v1"]
    core = {r["name"]: r for r in client.get("/api/v1").json()["resources"]}
    assert {"namespaces", "events", "configmaps", "pods", "services", "secrets", "nodes"} <= set(core)
    assert core["namespaces"]["namespaced"] is False and core["configmaps"]["namespaced"] is True
    assert {"list", "watch", "patch"} <= set(core["configmaps"]["verbs"])

    groups = {g["name"]: g for g in client.get("/apis").json()["groups"]}
    assert {"apps", "policy", "discovery.k8s.io", "events.k8s.io", "apiextensions.k8s.io", "kvharbor.io"} <= set(groups)
    assert groups["kvharbor.io"]["preferredVersion"]["version"] == "v1alpha1"
    assert client.get("/apis/kvharbor.io").json()["kind"] == "APIGroup"

    apps = {r["name"] for r in client.get("/apis/apps/v1").json()["resources"]}
    assert {"deployments", "deployments/status"} <= apps
    custom = {r["name"]: r for r in client.get("/apis/kvharbor.io/v1alpha1").json()["resources"]}
    assert custom["inferenceservices"]["kind"] == "InferenceService"
    assert custom["inferenceservices"]["shortNames"] == ["kvsvc"]
    assert "inferenceservices/status" in custom and "tenants/status" in custom

    for path in ("/nope", "/apis/nope.io/v1", "/api/v1/widgets", "/apis/kvharbor.io/v9"):
        response = client.get(path)
        assert response.status_code == 404
        assert response.json()["kind"] == "Status" and response.json()["code"] == 404


def test_registered_crds_and_default_namespace_are_served(client):
    crds = client.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions").json()
    assert crds["kind"] == "CustomResourceDefinitionList"
    assert {i["metadata"]["name"] for i in crds["items"]} == {"inferenceservices.kvharbor.io", "tenants.kvharbor.io"}
    assert client.get("/api/v1/namespaces/default").json()["status"]["phase"] == "Active"


def test_a_crd_created_over_http_is_served_at_once(client):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "widgets.example.com"},
           "spec": {"group": "example.com", "scope": "Cluster",
                    "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                    "versions": [{"name": "v1", "served": True, "storage": True}]}}
    assert client.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd).status_code == 201
    widgets = {r["name"]: r for r in client.get("/apis/example.com/v1").json()["resources"]}
    assert widgets["widgets"]["namespaced"] is False and "widgets/status" not in widgets
    assert client.post("/apis/example.com/v1/widgets", json={"metadata": {"name": "w"}}).status_code == 201
    assert client.delete("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com").is_success
    assert client.get("/apis/example.com/v1/widgets/w").status_code == 404


# --- CRUD ----------------------------------------------------------------------------------------


def test_create_get_replace_delete(client, double):
    created = client.post(CM, json=configmap("a"))
    assert created.status_code == 201
    meta = created.json()["metadata"]
    assert meta["namespace"] == "default" and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert "generation" not in meta  # a ConfigMap has no spec

    assert client.post(CM, json=configmap("a")).json()["reason"] == "AlreadyExists"
    assert client.post(CM, json=configmap("a")).status_code == 409
    assert client.get(f"{CM}/missing").status_code == 404

    fetched = client.get(f"{CM}/a").json()
    assert fetched["apiVersion"] == "v1" and fetched["kind"] == "ConfigMap" and fetched["data"] == {"k": "v"}

    fetched["data"] = {"k": "w"}
    replaced = client.put(f"{CM}/a", json=fetched)
    assert replaced.status_code == 200
    assert replaced.json()["metadata"]["uid"] == meta["uid"]
    assert int(replaced.json()["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    stale = client.put(f"{CM}/a", json={**fetched, "data": {"k": "x"}})  # still carries the old version
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"

    assert client.delete(f"{CM}/a").status_code == 200
    assert client.get(f"{CM}/a").status_code == 404
    assert client.delete(f"{CM}/a").status_code == 404
    assert [m for m, _ in double.writes] == ["POST", "PUT", "DELETE"]


def test_create_rules_for_names_namespaces_and_scopes(client):
    generated = client.post(CM, json={"metadata": {"generateName": "gen-"}, "data": {}}).json()
    assert generated["metadata"]["name"].startswith("gen-") and len(generated["metadata"]["name"]) == 9
    assert client.post(CM, json={"metadata": {}}).status_code == 422
    assert client.post(CM, params={"dryRun": "All"}, json=configmap("dry")).status_code == 400
    wrong_ns = client.post(CM, json={"metadata": {"name": "x", "namespace": "other"}})
    assert wrong_ns.status_code == 400
    assert client.post("/api/v1/namespaces/elsewhere/configmaps", json=configmap("x")).status_code == 201
    mismatched = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "y"}}
    assert client.post(CM, json=mismatched).status_code == 400
    # Cluster-scoped kinds have no namespaced path, namespaced items no cluster-wide path.
    assert client.get("/api/v1/namespaces/default/nodes").status_code == 404
    assert client.get("/api/v1/configmaps/x").status_code == 404
    assert client.post("/api/v1/configmaps", json=configmap("z")).status_code == 405
    assert client.post("/api/v1/nodes", json={"metadata": {"name": "n1"}}).status_code == 201
    everywhere = client.get("/api/v1/configmaps").json()
    assert {(i["metadata"]["namespace"], i["metadata"]["name"]) for i in everywhere["items"]} >= {
        ("default", generated["metadata"]["name"]), ("elsewhere", "x")}
    assert everywhere["kind"] == "ConfigMapList" and everywhere["metadata"]["resourceVersion"]


def test_events_are_stored_in_both_event_apis(client):
    body = {"metadata": {"generateName": "ev-"}, "reason": "Test", "message": "hello",
            "involvedObject": {"kind": "ConfigMap", "name": "a", "namespace": "default"}}
    assert client.post("/api/v1/namespaces/default/events", json=body).status_code == 201
    new_style = {"metadata": {"generateName": "ev-"}, "reason": "Test", "note": "hello", "action": "Did"}
    assert client.post("/apis/events.k8s.io/v1/namespaces/default/events", json=new_style).status_code == 201
    assert len(client.get("/api/v1/namespaces/default/events").json()["items"]) == 1
    assert len(client.get("/apis/events.k8s.io/v1/events").json()["items"]) == 1


# --- patches -------------------------------------------------------------------------------------


def test_merge_patch_and_strategic_merge_patch(client):
    client.post(CM, json=configmap("a", labels={"x": "1", "y": "2"}))
    patched = client.patch(f"{CM}/a", headers=MERGE, json={"metadata": {"labels": {"x": None, "z": "3"}},
                                                          "data": {"n": "m"}}).json()
    assert patched["metadata"]["labels"] == {"y": "2", "z": "3"} and patched["data"] == {"k": "v", "n": "m"}
    strategic = {"Content-Type": "application/strategic-merge-patch+json"}
    assert client.patch(f"{CM}/a", headers=strategic, json={"data": {"k": None}}).json()["data"] == {"n": "m"}
    assert client.patch(f"{CM}/a", headers={"Content-Type": "application/apply-patch+yaml"},
                        content=b"data: {}").status_code == 415
    assert client.patch(f"{CM}/missing", headers=MERGE, json={"data": {}}).status_code == 404
    stale = client.patch(f"{CM}/a", headers=MERGE, json={"metadata": {"resourceVersion": "1"}, "data": {}})
    assert stale.status_code == 409


def test_json_patch_operations_and_failed_test_changes_nothing(client, double):
    client.post(CM, json=configmap("a"))
    ops = [
        {"op": "add", "path": "/metadata/finalizers", "value": ["one"]},
        {"op": "add", "path": "/metadata/finalizers/-", "value": "two"},
        {"op": "add", "path": "/metadata/annotations", "value": {"a/b": "slash"}},
        {"op": "test", "path": "/metadata/annotations/a~1b", "value": "slash"},
        {"op": "copy", "from": "/data/k", "path": "/data/copied"},
        {"op": "move", "from": "/data/k", "path": "/data/moved"},
        {"op": "replace", "path": "/metadata/finalizers/0", "value": "uno"},
        {"op": "remove", "path": "/metadata/finalizers/1"},
    ]
    patched = client.patch(f"{CM}/a", headers=JSON_PATCH, json=ops)
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["metadata"]["finalizers"] == ["uno"] and body["data"] == {"copied": "v", "moved": "v"}

    writes_before, rv = list(double.writes), body["metadata"]["resourceVersion"]
    failing = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
               {"op": "remove", "path": "/metadata/finalizers"}]
    response = client.patch(f"{CM}/a", headers=JSON_PATCH, json=failing)
    assert response.status_code == 422 and response.json()["kind"] == "Status"
    assert client.get(f"{CM}/a").json()["metadata"]["finalizers"] == ["uno"]
    assert client.get(f"{CM}/a").json()["metadata"]["resourceVersion"] == rv
    assert double.writes == writes_before
    for bad in ([{"op": "remove", "path": "/nope"}], [{"op": "replace", "path": "/data/zz", "value": 1}],
                [{"op": "frobnicate", "path": "/data"}], {"not": "a list"}):
        assert client.patch(f"{CM}/a", headers=JSON_PATCH, json=bad).status_code == 422
    # kopf's finalizer removal: test the version, then drop the whole list.
    kopf_style = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                  {"op": "remove", "path": "/metadata/finalizers"}]
    assert "finalizers" not in client.patch(f"{CM}/a", headers=JSON_PATCH, json=kopf_style).json()["metadata"]


# --- status subresource and generation -----------------------------------------------------------


def test_status_subresource_isolation(client):
    created = client.post(DEPLOY, json={**deployment("d"), "status": {"readyReplicas": 5}}).json()
    assert "status" not in created  # the subresource owns status: dropped on create
    client.patch(f"{DEPLOY}/d/status", headers=MERGE, json={"status": {"readyReplicas": 1}})
    main = client.patch(f"{DEPLOY}/d", headers=MERGE, json={"status": {"readyReplicas": 9}, "spec": {"replicas": 2}})
    assert main.json()["status"] == {"readyReplicas": 1} and main.json()["spec"]["replicas"] == 2
    everything = {"status": {"replicas": 2}, "spec": {"replicas": 7}, "metadata": {"labels": {"l": "x"}}}
    via_status = client.patch(f"{DEPLOY}/d/status", headers=MERGE, json=everything)
    body = via_status.json()
    assert body["status"] == {"readyReplicas": 1, "replicas": 2}
    assert body["spec"]["replicas"] == 2 and "labels" not in body["metadata"]
    assert client.get(f"{DEPLOY}/d/status").json()["status"]["replicas"] == 2
    full = client.get(f"{DEPLOY}/d").json()
    full["status"] = {"readyReplicas": 0}
    assert client.put(f"{DEPLOY}/d/status", json=full).json()["status"] == {"readyReplicas": 0}
    # ConfigMaps have no status subresource: neither /status nor a dropped status.
    client.post(CM, json=configmap("c"))
    assert client.get(f"{CM}/c/status").status_code == 404
    kept = client.patch("/api/v1/namespaces/default", headers=MERGE, json={"status": {"phase": "Terminating"}})
    assert kept.json()["status"]["phase"] == "Terminating"


def test_generation_bumps_only_for_spec_changes(client):
    assert client.post(DEPLOY, json=deployment("d")).json()["metadata"]["generation"] == 1
    generation = lambda: client.get(f"{DEPLOY}/d").json()["metadata"]["generation"]  # noqa: E731
    client.patch(f"{DEPLOY}/d", headers=MERGE, json={"metadata": {"labels": {"a": "b"}, "annotations": {"c": "d"}}})
    client.patch(f"{DEPLOY}/d/status", headers=MERGE, json={"status": {"readyReplicas": 1}})
    assert generation() == 1
    client.patch(f"{DEPLOY}/d", headers=MERGE, json={"spec": {"replicas": 3}})
    assert generation() == 2
    custom = client.post(ISVC, json={**isvc("s")}).json()
    assert custom["metadata"]["generation"] == 1


def test_noop_writes_change_nothing_and_are_not_recorded(client, double):
    client.post(DEPLOY, json=deployment("d", replicas=2))
    before = client.get(f"{DEPLOY}/d").json()
    writes = list(double.writes)
    rv = before["metadata"]["resourceVersion"]
    assert client.patch(f"{DEPLOY}/d", headers=MERGE, json={"spec": {"replicas": 2}}).status_code == 200
    assert client.patch(f"{DEPLOY}/d", headers=MERGE, json={"metadata": {"labels": {}}}).status_code == 200
    assert client.patch(f"{DEPLOY}/d", headers=MERGE, json={"status": {"readyReplicas": 3}}).status_code == 200
    assert client.put(f"{DEPLOY}/d", json=before).status_code == 200
    after = client.get(f"{DEPLOY}/d").json()
    assert after == before and double.writes == writes
    assert watch(client, DEPLOY, resourceVersion=rv) == []
    client.patch(f"{DEPLOY}/d", headers=MERGE, json={"spec": {"replicas": 3}})
    assert double.writes == [*writes, ("PATCH", "/apis/apps/v1/namespaces/default/deployments/d")]


# --- watch ---------------------------------------------------------------------------------------


def test_watch_from_a_resource_version_and_from_now(client):
    client.post(CM, json=configmap("old"))
    rv = client.get(CM).json()["metadata"]["resourceVersion"]
    client.post(CM, json=configmap("a"))
    client.patch(f"{CM}/a", headers=MERGE, json={"data": {"k": "2"}})
    client.delete(f"{CM}/old")
    client.post("/api/v1/namespaces/other/configmaps", json=configmap("elsewhere"))
    events = watch(client, CM, resourceVersion=rv)
    assert summary(events) == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "old")]
    assert events[1]["object"]["data"] == {"k": "2"} and events[1]["object"]["kind"] == "ConfigMap"
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(rv)
    # Without a version: the current state first, as ADDED; cluster-wide sees every namespace.
    assert summary(watch(client, CM)) == [("ADDED", "a")]
    assert {name for _, name in summary(watch(client, "/api/v1/configmaps"))} == {"a", "elsewhere"}


def test_watch_sees_changes_made_while_it_is_open(client, double):
    rv = client.get(CM).json()["metadata"]["resourceVersion"]
    result: list[dict] = []
    reader = threading.Thread(target=lambda: result.extend(watch(client, CM, resourceVersion=rv, timeoutSeconds="3")))
    reader.start()
    wait_for(lambda: any("watch=true" in path for _, path in double.requests), 10, "the watch request")
    double.create(configmap("live"))
    double.delete("v1", "ConfigMap", "live", "default")
    reader.join(timeout=15)
    assert not reader.is_alive()
    assert summary(result) == [("ADDED", "live"), ("DELETED", "live")]


def test_watch_label_selector_turns_transitions_into_added_and_deleted(client):
    rv = client.get(CM).json()["metadata"]["resourceVersion"]
    client.post(CM, json=configmap("a", labels={"team": "x"}))
    client.patch(f"{CM}/a", headers=MERGE, json={"metadata": {"labels": {"team": "y"}}})
    client.patch(f"{CM}/a", headers=MERGE, json={"metadata": {"labels": {"team": "x"}}})
    client.patch(f"{CM}/a", headers=MERGE, json={"data": {"k": "2"}})
    events = watch(client, CM, resourceVersion=rv, labelSelector="team=x")
    assert summary(events) == [("ADDED", "a"), ("DELETED", "a"), ("ADDED", "a"), ("MODIFIED", "a")]


def test_watch_too_old_version_is_410_and_bookmarks_are_sent(tmp_path):
    with KubeAPIDouble(history_limit=3, bookmark_interval=0.2) as api, httpx.Client(base_url=api.url) as http:
        for i in range(5):
            api.create(configmap(f"c{i}"))
        events = watch(http, CM, resourceVersion="1")
        assert [e["type"] for e in events] == ["ERROR"] and events[0]["object"]["code"] == 410
        current = http.get(CM).json()["metadata"]["resourceVersion"]
        events = watch(http, CM, resourceVersion=current, allowWatchBookmarks="true")
        assert events and {e["type"] for e in events} == {"BOOKMARK"}
        assert events[0]["object"]["metadata"]["resourceVersion"] == current
        assert http.get(CM, params={"watch": "true", "resourceVersion": "abc"}).status_code == 400
        initial = watch(http, CM, sendInitialEvents="true", timeoutSeconds="1")
        assert [e["type"] for e in initial][:6] == ["ADDED"] * 5 + ["BOOKMARK"]
        assert initial[5]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_stop_closes_open_watches():
    api = KubeAPIDouble().start()
    done = threading.Event()

    def endless_watch():
        with httpx.Client(base_url=api.url, timeout=30) as http, \
                http.stream("GET", CM, params={"watch": "true"}) as response:
            for _ in response.iter_lines():
                pass
        done.set()

    reader = threading.Thread(target=endless_watch, daemon=True)
    try:
        reader.start()
        wait_for(lambda: api.requests, 10, "the watch request")
    finally:
        api.stop()
        api.stop()  # idempotent
    reader.join(timeout=15)
    assert done.is_set()


# --- selectors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("selector", "names"), [
    ("tier=web", {"a", "b"}),
    ("tier==web,env=prod", {"a"}),
    ("tier!=web", {"c", "d"}),
    ("env", {"a", "b", "c"}),
    ("!env", {"d"}),
    ("env in (prod, dev),tier", {"a", "b", "c"}),
    ("env notin (prod)", {"b", "c", "d"}),
])
def test_label_selectors(client, selector, names):
    for name, labels in {"a": {"tier": "web", "env": "prod"}, "b": {"tier": "web", "env": "dev"},
                         "c": {"tier": "db", "env": "dev"}, "d": {"tier": "db"}}.items():
        client.post(CM, json=configmap(name, labels=labels))
    items = client.get(CM, params={"labelSelector": selector}).json()["items"]
    assert {i["metadata"]["name"] for i in items} == names


def test_field_selectors_and_bad_selectors(client):
    for name in ("a", "b"):
        client.post(CM, json=configmap(name))
    named = client.get("/api/v1/configmaps", params={"fieldSelector": "metadata.name=a"}).json()["items"]
    assert [i["metadata"]["name"] for i in named] == ["a"]
    scoped = client.get("/api/v1/configmaps", params={"fieldSelector": "metadata.namespace!=default"}).json()
    assert scoped["items"] == []
    assert client.get(CM, params={"fieldSelector": "status.phase=Running"}).status_code == 400
    assert client.get(CM, params={"labelSelector": "a in (b"}).status_code == 400


# --- deletion ------------------------------------------------------------------------------------


def test_finalizers_hold_deletion_until_emptied(client, double):
    rv = client.get(ISVC).json()["metadata"]["resourceVersion"]
    client.post(ISVC, json={**isvc("s"), "metadata": {"name": "s", "finalizers": ["example.com/hold"]}})
    deleting = client.delete(f"{ISVC}/s")
    assert deleting.status_code == 200
    meta = deleting.json()["metadata"]
    assert meta["deletionTimestamp"] and meta["deletionGracePeriodSeconds"] == 0
    assert meta["generation"] == 2  # the real server bumps generation when deletion starts
    assert client.get(f"{ISVC}/s").status_code == 200
    writes = len(double.writes)
    assert client.delete(f"{ISVC}/s").status_code == 200 and len(double.writes) == writes  # already deleting
    more = client.patch(f"{ISVC}/s", headers=MERGE, json={"metadata": {"finalizers": ["example.com/hold", "new"]}})
    assert more.status_code == 422
    client.patch(f"{ISVC}/s", headers=MERGE, json={"metadata": {"finalizers": None}})
    assert client.get(f"{ISVC}/s").status_code == 404
    assert summary(watch(client, ISVC, resourceVersion=rv)) == [
        ("ADDED", "s"), ("MODIFIED", "s"), ("MODIFIED", "s"), ("DELETED", "s")]


def test_owner_references_cascade_with_finalizers_and_other_owners(client, double):
    owner = client.post(ISVC, json=isvc("owner")).json()
    other = client.post(CM, json=configmap("other-owner")).json()

    def ref(obj, kind):
        return {"apiVersion": obj["apiVersion"], "kind": kind, "name": obj["metadata"]["name"],
                "uid": obj["metadata"]["uid"]}

    dep = client.post(DEPLOY, json={**deployment("d"), "metadata": {
        "name": "d", "ownerReferences": [ref(owner, "InferenceService")]}}).json()
    client.post(CM, json={**configmap("grandchild"), "metadata": {
        "name": "grandchild", "ownerReferences": [ref(dep, "Deployment")]}})
    client.post(CM, json={**configmap("held"), "metadata": {
        "name": "held", "finalizers": ["x/y"], "ownerReferences": [ref(owner, "InferenceService")]}})
    client.post(CM, json={**configmap("shared"), "metadata": {
        "name": "shared", "ownerReferences": [ref(owner, "InferenceService"), ref(other, "ConfigMap")]}})

    double.delete("kvharbor.io/v1alpha1", "InferenceService", "owner", "default")
    assert client.get(f"{DEPLOY}/d").status_code == 404
    assert client.get(f"{CM}/grandchild").status_code == 404
    assert client.get(f"{CM}/held").json()["metadata"]["deletionTimestamp"]
    assert client.get(f"{CM}/shared").json()["metadata"]["ownerReferences"] == [ref(other, "ConfigMap")]


# --- direct access -------------------------------------------------------------------------------


def test_direct_access_methods(double):
    created = double.create(deployment("d"))
    with pytest.raises(KeyError):
        double.create(deployment("d"))
    applied = double.apply(deployment("d", replicas=4))
    assert applied["metadata"]["uid"] == created["metadata"]["uid"]
    assert applied["metadata"]["creationTimestamp"] == created["metadata"]["creationTimestamp"]
    assert applied["spec"]["replicas"] == 4 and applied["metadata"]["generation"] == 2
    ready = double.patch_status("apps/v1", "Deployment", "d", "default", {"readyReplicas": 4})
    assert ready["status"] == {"readyReplicas": 4}
    assert double.get("apps/v1", "Deployment", "d", "default")["status"]["readyReplicas"] == 4
    assert double.get("apps/v1", "Deployment", "missing", "default") is None
    assert [d["metadata"]["name"] for d in double.list("apps/v1", "Deployment")] == ["d"]
    assert double.list("apps/v1", "Deployment", "other") == []
    assert [n["metadata"]["name"] for n in double.list("v1", "Namespace")] == ["default"]
    double.delete("apps/v1", "Deployment", "d", "default")
    assert double.get("apps/v1", "Deployment", "d", "default") is None
    with pytest.raises(LookupError):
        double.delete("apps/v1", "Deployment", "d", "default")
    assert double.writes == []  # only HTTP requests are recorded


# --- real clients --------------------------------------------------------------------------------


def test_official_kubernetes_client(double, tmp_path):
    kubernetes = pytest.importorskip("kubernetes")
    config = kubernetes.client.Configuration()
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig", namespace="default")
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=config)
    with kubernetes.client.ApiClient(config) as api_client:
        core, apps = kubernetes.client.CoreV1Api(api_client), kubernetes.client.AppsV1Api(api_client)
        core.create_namespaced_config_map("default", {"metadata": {"name": "cm", "labels": {"a": "b"}},
                                                      "data": {"k": "v"}})
        maps = core.list_namespaced_config_map("default", label_selector="a=b")
        assert [m.data for m in maps.items] == [{"k": "v"}]
        created = apps.create_namespaced_deployment("default", deployment("d"))
        assert created.metadata.generation == 1 and created.metadata.uid
        apps.patch_namespaced_deployment("d", "default", {"spec": {"replicas": 3}})
        double.patch_status("apps/v1", "Deployment", "d", "default", {"readyReplicas": 3})
        assert apps.read_namespaced_deployment_status("d", "default").status.ready_replicas == 3
        with pytest.raises(kubernetes.client.ApiException) as missing:
            core.read_namespaced_config_map("nope", "default")
        assert missing.value.status == 404
        stream = kubernetes.watch.Watch().stream(core.list_namespaced_config_map, "default", timeout_seconds=1)
        assert [(e["type"], e["object"].metadata.name) for e in stream] == [("ADDED", "cm")]
        apps.delete_namespaced_deployment("d", "default")
        assert apps.list_namespaced_deployment("default").items == []


OPERATOR = textwrap.dedent("""
    import kopf

    @kopf.on.create('kvharbor.io', 'v1alpha1', 'inferenceservices')
    def created(spec, patch, body, **_):
        patch.status['phase'] = 'Pending'
        kopf.info(body, reason='Seen', message='created')  # exercises event posting
        return {'model': spec['model']['name']}

    @kopf.on.delete('kvharbor.io', 'v1alpha1', 'inferenceservices')
    def deleted(**_):
        pass  # its presence makes kopf add a finalizer
""")


@pytest.fixture
def kopf_operator(double, tmp_path):
    """The real kopf, as a subprocess against the double; always stopped, log printed on failure."""
    (tmp_path / "operator.py").write_text(OPERATOR)
    env = {**os.environ, "KUBECONFIG": str(double.write_kubeconfig(tmp_path / "kubeconfig"))}
    log_path = tmp_path / "kopf.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--standalone", "-A", "--verbose", str(tmp_path / "operator.py")],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        print(log_path.read_text()[-4000:])
        print("requests:", *double.requests[-40:], sep="\n  ")


@pytest.mark.slow  # the real kopf process
def test_real_kopf_reconciles_against_the_double(double, kopf_operator):
    double.create(isvc("s"))

    def reconciled():
        obj = double.get("kvharbor.io/v1alpha1", "InferenceService", "s", "default")
        return obj if obj["metadata"].get("finalizers") and obj.get("status", {}).get("created") else None

    obj = wait_for(reconciled, 30, "kopf to add its finalizer and patch status")
    assert obj["status"] == {"phase": "Pending", "created": {"model": "m"}}
    assert kopf_operator.poll() is None
    events = wait_for(lambda: double.list("v1", "Event", "default"), 30, "kopf's event")
    assert events[0]["involvedObject"]["name"] == "s" and events[0]["reason"] == "Seen"

    double.delete("kvharbor.io/v1alpha1", "InferenceService", "s", "default")
    wait_for(lambda: double.get("kvharbor.io/v1alpha1", "InferenceService", "s", "default") is None, 30,
             "kopf to run the delete handler and release its finalizer")
    paths = [path for _, path in double.writes]
    assert f"{ISVC}/s/status" in paths  # status went through the subresource
