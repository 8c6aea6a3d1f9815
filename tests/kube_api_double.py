"""A TEST DOUBLE of a Kubernetes API server, for tests only. It is not a Kubernetes implementation.

No machine here has a real API server, so tests run the real kopf operator, the official
`kubernetes` client and plain httpx against this small in-memory aiohttp server instead. It serves
plain HTTP on 127.0.0.1 from a daemon thread with its own event loop.

What it models:
- Discovery: /version, /api, /api/v1, /apis, /apis/{group}, /apis/{group}/{version} (with `<plural>/status`
  entries, verbs, singular and short names), for the built-in resources below plus every served version
  of every CustomResourceDefinition given to the constructor or created through the API.
- Built-ins: core v1 namespaces and nodes (cluster-scoped), pods, services, configmaps, secrets, events,
  endpoints, serviceaccounts; apps/v1 deployments and policy/v1 poddisruptionbudgets (with status
  subresource); discovery.k8s.io/v1 endpointslices; events.k8s.io/v1 events; coordination.k8s.io/v1 leases
  (leader election: a PUT or patch carrying a stale metadata.resourceVersion answers 409, so two candidates
  cannot both win); apiextensions.k8s.io/v1 customresourcedefinitions (cluster-scoped; a created CRD is
  instantly Established and served).
- One global resourceVersion counter; uid, creationTimestamp, generateName, generation (starts at 1 for
  custom resources and for objects with `spec`; bumps only when something outside metadata and status
  changes, and when deletion of an object with finalizers starts, as the real server does).
- GET/list, POST (201; 409 AlreadyExists), PUT (409 Conflict on a stale metadata.resourceVersion), PATCH as
  JSON merge patch (RFC 7386) or JSON patch (RFC 6902, all six ops; a failed `test` answers 422 and changes
  nothing), DELETE. Errors are v1 Status objects.
- The status subresource: /status writes change only .status; main-endpoint writes keep the old .status;
  status is dropped on create. Resources without the subresource keep status written to the main endpoint.
- No-op writes change nothing: same resourceVersion, no watch event, not recorded in `writes`.
- More listeners on other loopback ports (`listen()`), one per client process, so a test can tell whose
  writes were whose: `writes_via` records each write with the URL of the listener it came in on.
- Finalizers: DELETE sets deletionTimestamp (grace period 0); the object goes away when a later write
  empties its finalizers; no new finalizers may be added while it is being deleted (422).
- Garbage collection of dependents by metadata.ownerReferences uid (cascading, same finalizer rules), at
  the moment the owner is removed; a dependent that still has a live owner only loses the dead reference.
- List/watch filters: labelSelector (=, ==, !=, exists, !key, in, notin) and fieldSelector on
  metadata.name / metadata.namespace only. Watches (watch=true|1) stream newline-delimited JSON events
  after a resourceVersion from an in-memory history (ERROR 410 once it is older than the history), send
  ADDED for all current objects when there is no resourceVersion (or "0"), honour timeoutSeconds,
  allowWatchBookmarks (periodic BOOKMARK) and sendInitialEvents, turn selector transitions into
  ADDED/DELETED like the watch cache, and close when the double stops.

What it does NOT model:
- No authentication or authorization (no RBAC, any client may do anything); plain HTTP, no TLS.
- No admission, no validation against OpenAPI or CRD schemas, no defaulting (CRD `default:` values are
  not applied), no name validation, no immutable fields, no pruning of unknown fields.
- No controllers: Deployment/PDB status never changes by itself (tests use `patch_status`), no
  ReplicaSets, pods, endpoints or endpoint slices are created, nothing is scheduled, pods are removed at
  once (no kubelet, no graceful termination), namespaces are never terminated or emptied.
- A namespace need not exist to create or delete objects in it; only a "default" Namespace is served.
- No server-side apply (application/apply-patch+yaml answers 415) and no managedFields; strategic
  merge patch is treated as a JSON merge patch (lists are replaced, not merged by key).
- No DELETE on collections, no dryRun (400), no propagationPolicy (always background GC, never orphaning
  or foreground), no deletion grace periods; GC is synchronous and not re-run for objects created with
  already-dangling owner references.
- List `limit`/`continue` and get/list `resourceVersion`/`resourceVersionMatch` are ignored: reads always
  return everything as it is now. resourceVersions are one global integer counter (clients should not care).
- `apply()` replaces the object but writes no last-applied-configuration annotation; PUT never creates.
- Events get no aggregation, series or TTL; watch history is bounded by count (`history_limit`), not time.
- Field selectors beyond metadata.name / metadata.namespace answer 400 (no status.phase, spec.nodeName,
  involvedObject.* and so on); no table output, no protobuf, no `?pretty`, no sub-resources other than
  status (no scale, logs, exec, eviction, binding, proxy, finalize); no OpenAPI (/openapi/*) documents.
- Core v1 events and events.k8s.io/v1 events are stored separately (the real server shares them).
- Leases are plain objects: nothing checks their fields or acts on their expiry (electing is the clients' job,
  as it is against a real server).
- CRD versions are served without conversion: every version returns the same stored body, only
  apiVersion differs. Deleting a CRD drops its objects at once, without their finalizers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import logging
import math
import random
import re
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml
from aiohttp import web

log = logging.getLogger(__name__)

ALL_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]
SYSTEM_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")
# Real API servers omit these when empty, so `[]` and absent must compare equal for no-op detection.
OMIT_WHEN_EMPTY = ("labels", "annotations", "finalizers", "ownerReferences")
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    has_status: bool = False
    custom: bool = False
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def store_key(self) -> tuple[str, str]:
        # All versions of one resource share storage, as they do in etcd.
        return (self.group, self.plural)


def _builtin(group, version, plural, kind, namespaced=True, short=(), status=False) -> ResourceType:
    return ResourceType(group, version, plural, kind, kind.lower(), namespaced, tuple(short), status)


BUILTINS = [
    _builtin("", "v1", "namespaces", "Namespace", namespaced=False, short=["ns"]),
    _builtin("", "v1", "nodes", "Node", namespaced=False, short=["no"]),
    _builtin("", "v1", "pods", "Pod", short=["po"]),
    _builtin("", "v1", "services", "Service", short=["svc"]),
    _builtin("", "v1", "configmaps", "ConfigMap", short=["cm"]),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "events", "Event", short=["ev"]),
    _builtin("", "v1", "endpoints", "Endpoints", short=["ep"]),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short=["sa"]),
    _builtin("apps", "v1", "deployments", "Deployment", short=["deploy"], status=True),
    _builtin("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short=["pdb"], status=True),
    _builtin("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    _builtin("events.k8s.io", "v1", "events", "Event", short=["ev"]),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, short=["crd", "crds"], status=True),
]


class KubeApiError(Exception):
    """An API failure; `status()` is the v1 Status body the HTTP API answers with."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


class AlreadyExistsError(KubeApiError, KeyError):
    pass


class NotFoundError(KubeApiError, LookupError):
    pass


class PatchError(Exception):
    pass


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _not_found(rt: ResourceType, name: str) -> NotFoundError:
    what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    return NotFoundError(404, "NotFound", f'{what} "{name}" not found')


def _bad_request(message: str) -> KubeApiError:
    return KubeApiError(400, "BadRequest", message)


def _invalid(message: str) -> KubeApiError:
    return KubeApiError(422, "Invalid", message)


# ---------------------------------------------------------------------------------------------------
# Patches


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch; returns a new document and never mutates its inputs."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _json_index(container: list, token: str, *, allow_end: bool) -> int:
    if allow_end and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    limit = len(container) if allow_end else len(container) - 1
    if int(token) > limit:
        raise PatchError(f"array index {token} out of range")
    return int(token)


def _json_get(doc, tokens: list[str]):
    for token in tokens:
        if isinstance(doc, dict) and token in doc:
            doc = doc[token]
        elif isinstance(doc, list):
            doc = doc[_json_index(doc, token, allow_end=False)]
        else:
            raise PatchError(f"path /{'/'.join(tokens)} does not exist")
    return doc


def _json_add(doc, tokens: list[str], value):
    if not tokens:
        return value
    parent = _json_get(doc, tokens[:-1])
    if isinstance(parent, list):
        parent.insert(_json_index(parent, tokens[-1], allow_end=True), value)
    elif isinstance(parent, dict):
        parent[tokens[-1]] = value
    else:
        raise PatchError("cannot add to a scalar")
    return doc


def _json_remove(doc, tokens: list[str]):
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _json_get(doc, tokens[:-1])
    if isinstance(parent, list):
        return parent.pop(_json_index(parent, tokens[-1], allow_end=False))
    if isinstance(parent, dict) and tokens[-1] in parent:
        return parent.pop(tokens[-1])
    raise PatchError(f"path /{'/'.join(tokens)} does not exist")


def json_patch(doc, ops) -> object:
    """RFC 6902 JSON patch on a copy of `doc`; any failure (a failed `test` included) raises PatchError."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "path" not in op:
            raise PatchError(f"malformed operation {op!r}")
        name, tokens = op.get("op"), _pointer(op["path"])
        if name in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"operation {name} needs a value")
        if name == "add":
            doc = _json_add(doc, tokens, copy.deepcopy(op["value"]))
        elif name == "remove":
            _json_remove(doc, tokens)
        elif name == "replace":
            _json_get(doc, tokens)  # must exist
            if tokens:
                _json_remove(doc, tokens)
            doc = _json_add(doc, tokens, copy.deepcopy(op["value"]))
        elif name == "test":
            if _json_get(doc, tokens) != op["value"]:
                raise PatchError(f"test failed at {op['path']}")
        elif name in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            value = copy.deepcopy(_json_get(doc, source))
            if name == "move":
                _json_remove(doc, source)
            doc = _json_add(doc, tokens, value)
        else:
            raise PatchError(f"unknown operation {name!r}")
    return doc


# ---------------------------------------------------------------------------------------------------
# Selectors

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([^\s!=]+)\s*(==|=|!=)\s*([^\s!=]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^\s!=(),]+)\s*$")


def _split_terms(selector: str) -> list[str]:
    # Commas separate terms, except inside the parentheses of `in`/`notin`.
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term for term in terms if term.strip()]


def parse_label_selector(selector: str | None) -> list[tuple[str, str, set[str]]]:
    """Terms as (key, operator, values); raises KubeApiError 400 on syntax errors."""
    parsed = []
    for term in _split_terms(selector or ""):
        if match := _SET_TERM.match(term):
            values = {v.strip() for v in match.group(3).split(",") if v.strip()}
            parsed.append((match.group(1), match.group(2), values))
        elif match := _EQ_TERM.match(term):
            operator = "!=" if match.group(2) == "!=" else "="
            parsed.append((match.group(1), operator, {match.group(3)}))
        elif match := _EXISTS_TERM.match(term):
            parsed.append((match.group(2), "!" if match.group(1) else "exists", set()))
        else:
            raise _bad_request(f"unable to parse requirement: {term!r}")
    return parsed


def _labels_match(terms, labels: dict) -> bool:
    for key, operator, values in terms:
        present, value = key in labels, labels.get(key)
        ok = {
            "=": present and value in values,
            "in": present and value in values,
            "!=": not present or value not in values,
            "notin": not present or value not in values,
            "exists": present,
            "!": not present,
        }[operator]
        if not ok:
            return False
    return True


def parse_field_selector(selector: str | None) -> list[tuple[str, bool, str]]:
    """Terms as (field, wanted_equal, value); only metadata.name and metadata.namespace are known."""
    parsed = []
    for term in _split_terms(selector or ""):
        match = _EQ_TERM.match(term)
        if not match or match.group(1) not in ("metadata.name", "metadata.namespace"):
            raise _bad_request(f"field label not supported by this test double: {term!r}")
        parsed.append((match.group(1).split(".")[1], match.group(2) != "!=", match.group(3)))
    return parsed


def _fields_match(terms, obj: dict) -> bool:
    meta = obj.get("metadata", {})
    return all((meta.get(key, "") == value) == wanted for key, wanted, value in terms)


# ---------------------------------------------------------------------------------------------------
# Watches


@dataclass
class _Event:
    rv: int
    key: tuple[str, str]
    type: str
    obj: dict
    prev: dict | None  # the object before a MODIFIED, so selector transitions can be seen


@dataclass
class _Watcher:
    rt: ResourceType
    namespace: str | None
    labels: list
    fields: list
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event
    pending: collections.deque = field(default_factory=collections.deque)

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return _labels_match(self.labels, meta.get("labels") or {}) and _fields_match(self.fields, obj)

    def translate(self, event: _Event) -> str | None:
        # Like the watch cache: an object entering the selection is ADDED, one leaving it is DELETED.
        now, before = self.matches(event.obj), self.matches(event.prev)
        if event.type != "MODIFIED":
            return event.type if now else None
        if now and before:
            return "MODIFIED"
        return "ADDED" if now else ("DELETED" if before else None)

    def offer(self, event: _Event) -> None:
        kind = self.translate(event)
        if kind:
            self.pending.append({"type": kind, "object": event.obj})
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is listening
                self.loop.call_soon_threadsafe(self.wake.set)


# ---------------------------------------------------------------------------------------------------
# The double


class KubeAPIDouble:
    """In-memory API server for tests; see the module docstring for what it does and does not model."""

    def __init__(self, crd_files: Iterable[Path] = (), *, history_limit: int = 10_000,
                 bookmark_interval: float = 10.0) -> None:
        self.url = ""
        self.writes: list[tuple[str, str]] = []  # (method, path) of HTTP writes that changed something
        self.writes_via: list[tuple[str, str, str]] = []  # the same writes as (method, path, listener URL)
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every HTTP request, for debugging
        self._lock = threading.RLock()
        self._rv = 0
        self._history: collections.deque[_Event] = collections.deque(maxlen=history_limit)
        self._bookmark_interval = bookmark_interval
        self._objects: dict[tuple[str, str], dict[tuple[str, str], dict]] = collections.defaultdict(dict)
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._crd_types: dict[str, list[ResourceType]] = {}
        self._watchers: list[_Watcher] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._listeners: dict[int, str] = {}  # local port -> URL of each listener
        self._stopping = False
        for rt in BUILTINS:
            self._types[(rt.group, rt.version, rt.plural)] = rt
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}})
        for path in crd_files:
            for doc in yaml.safe_load_all(Path(path).read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    self.apply(doc)

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> KubeAPIDouble:
        if self._thread is not None:
            return self
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api-double", daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        return self

    def listen(self) -> str:
        """One more listener on a free loopback port, serving the same objects; returns its URL. Give each
        client process its own (a kubeconfig per listener) to tell their writes apart in `writes_via`."""
        if self._loop is None:
            raise RuntimeError("start() the double before adding a listener")
        return asyncio.run_coroutine_threadsafe(self._add_site(), self._loop).result(timeout=30)

    async def _serve(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A short shutdown timeout: open watches are already told to end before cleanup.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        return await self._add_site()

    async def _add_site(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # a free port, known before serving, and loopback only
        await web.SockSite(self._runner, sock).start()
        port = sock.getsockname()[1]
        self._listeners[port] = f"http://127.0.0.1:{port}"
        return self._listeners[port]

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        with self._lock:
            self._stopping = True
            for watcher in self._watchers:
                watcher.loop.call_soon_threadsafe(watcher.wake.set)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=15)
        if not self._thread.is_alive():
            self._loop.close()
        self._thread = self._loop = self._runner = None
        self._listeners.clear()

    def __enter__(self) -> KubeAPIDouble:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, namespace: str = "default", url: str | None = None) -> Path:
        """A kubeconfig for the double at `url` (a listener from `listen()`; default: the first one)."""
        if not self.url:
            raise RuntimeError("start() the double before writing a kubeconfig for it")
        name = "kube-api-double"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": {"server": url or self.url}}],
            "users": [{"name": name, "user": {}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
            "current-context": name,
        }
        path = Path(path)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # --- direct access for tests ---------------------------------------------------------------------

    def create(self, obj: dict) -> dict:
        rt = self._type_of(obj.get("apiVersion", ""), obj.get("kind", ""))
        with self._lock:
            created, _ = self._create(rt, self._namespace_of(rt, obj), obj)
            return self._out(rt, created)

    def apply(self, obj: dict) -> dict:
        rt = self._type_of(obj.get("apiVersion", ""), obj.get("kind", ""))
        namespace, name = self._namespace_of(rt, obj), obj.get("metadata", {}).get("name", "")
        with self._lock:
            if name and self._find(rt, namespace, name) is not None:
                body = copy.deepcopy(obj)
                body.setdefault("metadata", {}).pop("resourceVersion", None)  # like kubectl apply: no stale conflicts
                result, _ = self._update(rt, namespace, name, body, status_only=False)
            else:
                result, _ = self._create(rt, namespace, obj)
            return self._out(rt, result)

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
        rt = self._type_of(api_version, kind)
        with self._lock:
            obj = self._find(rt, namespace if rt.namespaced else None, name)
            return None if obj is None else self._out(rt, obj)

    def list(self, api_version: str, kind: str, namespace: str | None = None) -> list[dict]:
        rt = self._type_of(api_version, kind)
        with self._lock:
            namespace = namespace if rt.namespaced else None
            return [self._out(rt, obj) for obj in self._select(rt, namespace, [], [])]

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> None:
        rt = self._type_of(api_version, kind)
        with self._lock:
            self._delete(rt, namespace if rt.namespaced else None, name)

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: dict) -> dict:
        rt = self._type_of(api_version, kind)
        with self._lock:
            result, _ = self._patch(rt, namespace if rt.namespaced else None, name, MERGE, {"status": status},
                                    status_only=rt.has_status)
            return self._out(rt, result)

    # --- resource types ------------------------------------------------------------------------------

    def _type_of(self, api_version: str, kind: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        with self._lock:
            for rt in self._types.values():
                if (rt.group, rt.version, rt.kind) == (group, version, kind):
                    return rt
        raise NotFoundError(404, "NotFound", f"no resource type {kind} in {api_version or '(no apiVersion)'}")

    def _namespace_of(self, rt: ResourceType, obj: dict) -> str | None:
        if not rt.namespaced:
            return None
        return obj.get("metadata", {}).get("namespace") or "default"  # as kubectl's default context would

    def _register_crd(self, crd: dict) -> None:
        self._unregister_crd(crd["metadata"]["name"], drop_objects=False)
        spec, names = crd.get("spec", {}), crd.get("spec", {}).get("names", {})
        types = [
            ResourceType(
                group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()), has_status="status" in (
                    version.get("subresources") or {}), custom=True, categories=tuple(names.get("categories") or ()),
            )
            for version in spec.get("versions", [])
            if version.get("served", True)
        ]
        for rt in types:
            self._types[(rt.group, rt.version, rt.plural)] = rt
        self._crd_types[crd["metadata"]["name"]] = types

    def _unregister_crd(self, crd_name: str, *, drop_objects: bool) -> None:
        for rt in self._crd_types.pop(crd_name, []):
            self._types.pop((rt.group, rt.version, rt.plural), None)
            if drop_objects:
                for (namespace, name) in list(self._objects.get(rt.store_key, {})):
                    self._remove(rt, namespace or None, name)

    def _crd_status(self, crd: dict) -> dict:
        # There is no CRD controller: a created CRD is immediately accepted and established.
        spec = crd.get("spec", {})
        conditions = [{"type": kind, "status": "True", "reason": kind, "lastTransitionTime": _now()}
                      for kind in ("NamesAccepted", "Established")]
        stored = [v["name"] for v in spec.get("versions", []) if v.get("storage")]
        return {"acceptedNames": spec.get("names", {}), "conditions": conditions, "storedVersions": stored}

    # --- storage operations (callers hold the lock) --------------------------------------------------

    def _find(self, rt: ResourceType, namespace: str | None, name: str) -> dict | None:
        return self._objects[rt.store_key].get((namespace or "", name))

    def _select(self, rt: ResourceType, namespace: str | None, labels: list, fields: list) -> list[dict]:
        store = self._objects[rt.store_key]
        return [
            obj for (ns, _), obj in sorted(store.items())
            if (namespace is None or ns == namespace)
            and _labels_match(labels, obj["metadata"].get("labels") or {}) and _fields_match(fields, obj)
        ]

    def _out(self, rt: ResourceType, obj: dict) -> dict:
        body = {key: value for key, value in obj.items() if key not in ("apiVersion", "kind")}
        # A deep copy so callers cannot mutate stored objects, which the history shares.
        return {"apiVersion": rt.api_version, "kind": rt.kind, **copy.deepcopy(body)}

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, rt: ResourceType, kind: str, obj: dict, prev: dict | None = None) -> None:
        event = _Event(int(obj["metadata"]["resourceVersion"]), rt.store_key, kind, obj, prev)
        self._history.append(event)
        for watcher in self._watchers:
            if watcher.rt.store_key == rt.store_key:
                watcher.offer(event)

    def _check_body(self, rt: ResourceType, body) -> dict:
        if not isinstance(body, dict):
            raise _bad_request("the body must be a JSON object")
        api_version = body.get("apiVersion")
        if body.get("kind") not in (None, rt.kind) or (api_version and api_version.rpartition("/")[0] != rt.group):
            raise _bad_request(f"the body ({api_version}, {body.get('kind')}) does not match {rt.api_version} "
                               f"{rt.kind}")
        if not isinstance(body.get("metadata", {}), dict):
            raise _bad_request("metadata must be an object")
        return copy.deepcopy(body)

    def _set_identity(self, rt: ResourceType, obj: dict, namespace: str | None) -> dict:
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.setdefault("metadata", {})
        body_namespace = meta.get("namespace")
        if rt.namespaced:
            if body_namespace and body_namespace != namespace:
                raise _bad_request("the namespace of the provided object does not match the namespace sent on "
                                   "the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        for key in OMIT_WHEN_EMPTY:
            if key in meta and not meta[key]:
                del meta[key]
        return meta

    def _create(self, rt: ResourceType, namespace: str | None, body) -> tuple[dict, bool]:
        obj = self._check_body(rt, body)
        meta = self._set_identity(rt, obj, namespace)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _invalid("metadata.name: Required value: name or generateName is required")
            meta["name"] = self._generate_name(rt, namespace, meta["generateName"])
        if self._find(rt, namespace, meta["name"]) is not None:
            what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            raise AlreadyExistsError(409, "AlreadyExists", f'{what} "{meta["name"]}" already exists')
        for key in (*SYSTEM_META, "resourceVersion", "managedFields", "selfLink"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=self._next_rv())
        if rt.custom or "spec" in obj:
            meta["generation"] = 1
        if rt.has_status:
            obj.pop("status", None)  # status is the subresource's to write
        if rt.kind == "CustomResourceDefinition":
            obj["status"] = self._crd_status(obj)
            self._register_crd(obj)
        if rt.kind == "Namespace":
            obj.setdefault("status", {"phase": "Active"})
        self._objects[rt.store_key][(namespace or "", meta["name"])] = obj
        self._emit(rt, "ADDED", obj)
        return obj, True

    def _generate_name(self, rt: ResourceType, namespace: str | None, prefix: str) -> str:
        alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the server's alphabet: no vowels, no look-alikes
        for _ in range(100):
            name = prefix + "".join(random.choices(alphabet, k=5))
            if self._find(rt, namespace, name) is None:
                return name
        raise KubeApiError(500, "InternalError", "could not generate a unique name")

    def _update(self, rt: ResourceType, namespace: str | None, name: str, body, *,
                status_only: bool) -> tuple[dict, bool]:
        old = self._find(rt, namespace, name)
        if old is None:
            raise _not_found(rt, name)
        new = self._check_body(rt, body)
        meta = self._set_identity(rt, new, namespace)
        if meta.get("name", name) != name:
            raise _bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL")
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise KubeApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.plural} "{name}": the '
                                                "object has been modified; please apply your changes to the "
                                                "latest version and try again")
        candidate = self._merge_update(rt, old, new, status_only)
        return self._commit(rt, old, candidate)

    def _merge_update(self, rt: ResourceType, old: dict, new: dict, status_only: bool) -> dict:
        if status_only:
            candidate = copy.deepcopy(old)
            if "status" in new:
                candidate["status"] = new["status"]
            else:
                candidate.pop("status", None)
            return candidate
        candidate = new
        meta = candidate["metadata"]
        meta["name"] = old["metadata"]["name"]
        for key in (*SYSTEM_META, "resourceVersion"):
            meta.pop(key, None)
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
        meta.pop("managedFields", None)
        if rt.has_status:
            candidate.pop("status", None)
            if "status" in old:
                candidate["status"] = copy.deepcopy(old["status"])
        added = set(meta.get("finalizers", [])) - set(old["metadata"].get("finalizers", []))
        if "deletionTimestamp" in old["metadata"] and added:
            raise _invalid(f"metadata.finalizers: Forbidden: no new finalizers can be added if the object is being "
                           f"deleted, found new finalizers {sorted(added)}")
        return candidate

    def _commit(self, rt: ResourceType, old: dict, candidate: dict) -> tuple[dict, bool]:
        candidate["apiVersion"] = old["apiVersion"]  # stored as created; responses show the asked version
        if candidate == old:
            return old, False  # real servers skip no-op updates: no new resourceVersion, no event
        meta = candidate["metadata"]
        if "generation" in meta and _spec_of(candidate) != _spec_of(old):
            meta["generation"] = old["metadata"]["generation"] + 1
        meta["resourceVersion"] = self._next_rv()
        namespace = meta.get("namespace")
        self._objects[rt.store_key][(namespace or "", meta["name"])] = candidate
        if rt.kind == "CustomResourceDefinition":
            self._register_crd(candidate)
        self._emit(rt, "MODIFIED", candidate, old)
        if "deletionTimestamp" in meta and not meta.get("finalizers"):
            return self._remove(rt, namespace, meta["name"]), True
        return candidate, True

    def _patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, patch, *,
               status_only: bool) -> tuple[dict, bool]:
        old = self._find(rt, namespace, name)
        if old is None:
            raise _not_found(rt, name)
        current = self._out(rt, old)
        _check_patch_type(content_type)
        try:
            patched = json_patch(current, patch) if content_type == JSON_PATCH else merge_patch(current, patch)
        except PatchError as e:
            raise _invalid(f"the server rejected our request due to an error in our request: {e}") from None
        return self._update(rt, namespace, name, patched, status_only=status_only)

    def _delete(self, rt: ResourceType, namespace: str | None, name: str,
                preconditions: dict | None = None) -> tuple[dict, bool]:
        old = self._find(rt, namespace, name)
        if old is None:
            raise _not_found(rt, name)
        for key in ("uid", "resourceVersion"):
            if (preconditions or {}).get(key) not in (None, old["metadata"].get(key)):
                raise KubeApiError(409, "Conflict", f"Precondition failed: {key} does not match")
        if "deletionTimestamp" in old["metadata"]:
            return old, False  # already being deleted; the finalizers' owners will finish it
        if not old["metadata"].get("finalizers"):
            return self._remove(rt, namespace, name), True
        candidate = copy.deepcopy(old)
        meta = candidate["metadata"]
        meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        if "generation" in meta:
            meta["generation"] += 1  # the real server also bumps generation when deletion starts
        meta["resourceVersion"] = self._next_rv()
        self._objects[rt.store_key][(namespace or "", name)] = candidate
        self._emit(rt, "MODIFIED", candidate, old)
        return candidate, True

    def _remove(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        obj = copy.deepcopy(self._objects[rt.store_key].pop((namespace or "", name)))
        obj["metadata"]["resourceVersion"] = self._next_rv()  # a DELETED event carries the deletion's version
        self._emit(rt, "DELETED", obj)
        if rt.kind == "CustomResourceDefinition":
            self._unregister_crd(name, drop_objects=True)
        self._collect_garbage(obj["metadata"]["uid"])
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        # Synchronous where the real garbage collector is eventual: simpler to test against.
        dependents = [
            (key, ns, name, obj) for key, store in self._objects.items() for (ns, name), obj in store.items()
            if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])
        ]
        live_uids = {obj["metadata"]["uid"] for store in self._objects.values() for obj in store.values()}
        for key, ns, name, obj in dependents:
            rt = next((rt for rt in self._types.values() if rt.store_key == key), None)
            if rt is None or self._find(rt, ns or None, name) is not obj:
                continue  # already removed or changed by an earlier cascade step
            remaining = [ref for ref in obj["metadata"]["ownerReferences"] if ref.get("uid") != owner_uid]
            if any(ref.get("uid") in live_uids for ref in remaining):
                candidate = copy.deepcopy(obj)
                candidate["metadata"]["ownerReferences"] = remaining
                self._commit(rt, obj, candidate)
            else:
                self._delete(rt, ns or None, name)

    # --- HTTP ----------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        log.debug("%s %s", request.method, request.path_qs)
        with self._lock:
            self.requests.append((request.method, request.path_qs))
        try:
            return await self._route(request)
        except KubeApiError as e:
            return web.json_response(e.status(), status=e.code)
        except Exception as e:  # a bug in the double: answer like a server would, and keep serving
            log.exception("kube-api-double failed on %s %s", request.method, request.path_qs)
            error = KubeApiError(500, "InternalError", f"{type(e).__name__}: {e}")
            return web.json_response(error.status(), status=500)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        parts = [part for part in request.path.split("/") if part]
        if parts == ["version"]:
            return web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0",
                                      "platform": "linux/amd64", "goVersion": "go1.22.0",
                                      "compiler": "gc", "buildDate": "2024-04-17T00:00:00Z"})
        if parts == ["api"]:
            return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.removeprefix("http://")}]})
        if parts == ["apis"]:
            return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": self._groups()})
        if len(parts) == 2 and parts[0] == "apis":
            group = next((g for g in self._groups() if g["name"] == parts[1]), None)
            if group is None:
                raise self._path_not_found(request)
            return web.json_response({"kind": "APIGroup", "apiVersion": "v1", **group})
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise self._path_not_found(request)
        if not rest:
            return web.json_response(self._resource_list(group, version, request))
        return await self._serve_resource(request, *self._target(request, group, version, rest))

    def _path_not_found(self, request: web.Request) -> KubeApiError:
        return NotFoundError(404, "NotFound", f"the server could not find the requested resource ({request.path})")

    def _groups(self) -> list[dict]:
        with self._lock:
            versions: dict[str, list[str]] = {}
            for rt in self._types.values():
                if rt.group and rt.version not in versions.setdefault(rt.group, []):
                    versions[rt.group].append(rt.version)
        groups = []
        for name, names in versions.items():
            ordered = sorted(names, key=_version_priority, reverse=True)
            entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in ordered]
            groups.append({"name": name, "versions": entries, "preferredVersion": entries[0]})
        return groups

    def _resource_list(self, group: str, version: str, request: web.Request) -> dict:
        with self._lock:
            types = [rt for rt in self._types.values() if (rt.group, rt.version) == (group, version)]
        if not types:
            raise self._path_not_found(request)
        resources = []
        for rt in types:
            entry = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                     "kind": rt.kind, "verbs": ALL_VERBS}
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            if rt.has_status:
                resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": rt.kind, "verbs": STATUS_VERBS})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": types[0].api_version,
                "resources": resources}

    def _target(self, request, group: str, version: str, rest: list[str]):
        """(resource type, namespace, name, subresource) for the path after /api/v1 or /apis/G/V."""
        with self._lock:
            types = dict(self._types)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in types:
            namespace, rest = rest[1], rest[2:]
        rt = types.get((group, version, rest[0]))
        if rt is None or len(rest) > 3 or (namespace is not None and not rt.namespaced):
            raise self._path_not_found(request)
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if subresource is not None and (subresource != "status" or not rt.has_status):
            raise self._path_not_found(request)
        if rt.namespaced and namespace is None and name is not None:
            raise self._path_not_found(request)  # items of namespaced kinds live under namespaces/{ns}
        return rt, namespace, name, subresource

    async def _serve_resource(self, request, rt, namespace, name, subresource) -> web.StreamResponse:
        method, query = request.method, request.query
        if query.get("dryRun"):
            raise _bad_request("dryRun is not supported by this test double")
        if name is None and method == "GET":
            if query.get("watch", "").lower() in ("true", "1"):
                return await self._watch(request, rt, namespace)
            return web.json_response(self._list_body(rt, namespace, query))
        if name is None and method == "POST" and (namespace is not None or not rt.namespaced):
            body = await self._json_body(request)
            with self._lock:
                obj, changed = self._create(rt, namespace, body)
                return self._answer(request, rt, obj, changed, status=201)
        if name is None or method == "POST" or (subresource and method == "DELETE"):
            raise KubeApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                                                        "resource")
        return await self._serve_item(request, rt, namespace, name, status_only=subresource == "status")

    async def _serve_item(self, request, rt, namespace, name, *, status_only: bool) -> web.StreamResponse:
        method = request.method
        if method == "GET":
            with self._lock:
                obj = self._find(rt, namespace, name)
                if obj is None:
                    raise _not_found(rt, name)
                return web.json_response(self._out(rt, obj))
        if method == "PATCH":
            _check_patch_type(request.content_type)  # before parsing: the body need not be JSON
        body = await self._json_body(request, required=method != "DELETE")
        with self._lock:
            if method == "PUT":
                obj, changed = self._update(rt, namespace, name, body, status_only=status_only)
            elif method == "PATCH":
                obj, changed = self._patch(rt, namespace, name, request.content_type, body, status_only=status_only)
            elif method == "DELETE":
                preconditions = body.get("preconditions") if isinstance(body, dict) else None
                obj, changed = self._delete(rt, namespace, name, preconditions)
            else:
                raise KubeApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
            return self._answer(request, rt, obj, changed)

    def _answer(self, request, rt, obj, changed: bool, status: int = 200) -> web.Response:
        if changed:
            self.writes.append((request.method, request.path))
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            via = self._listeners.get(sockname[1], "") if sockname else ""
            self.writes_via.append((request.method, request.path, via))
        return web.json_response(self._out(rt, obj), status=status)

    async def _json_body(self, request: web.Request, required: bool = True):
        raw = await request.read()
        if not raw.strip():
            if required:
                raise _bad_request("the request has no body")
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise _bad_request(f"the body is not valid JSON: {e}") from None

    def _list_body(self, rt: ResourceType, namespace: str | None, query) -> dict:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"))
        with self._lock:
            items = [self._out(rt, obj) for obj in self._select(rt, namespace, labels, fields)]
            return {"apiVersion": rt.api_version, "kind": f"{rt.kind}List",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    # --- watch ---------------------------------------------------------------------------------------

    async def _watch(self, request: web.Request, rt: ResourceType, namespace: str | None) -> web.StreamResponse:
        query = request.query
        watcher = _Watcher(rt, namespace, parse_label_selector(query.get("labelSelector")),
                           parse_field_selector(query.get("fieldSelector")), asyncio.get_running_loop(),
                           asyncio.Event())
        since, timeout = query.get("resourceVersion") or "0", query.get("timeoutSeconds") or "0"
        if not since.isdigit() or not timeout.isdigit():
            raise _bad_request(f"invalid resourceVersion {since!r} or timeoutSeconds {timeout!r}")
        initial_end = query.get("sendInitialEvents", "").lower() == "true"
        with self._lock:
            first = self._start_watch(watcher, int(since), initial_end)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            if first is not None:
                await response.write(_line(first))  # the 410 ERROR: nothing else follows
            else:
                await self._stream(response, watcher, int(timeout), query)
        except ConnectionResetError:
            pass  # the client went away
        finally:
            with self._lock:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _start_watch(self, watcher: _Watcher, since: int, initial_end: bool) -> dict | None:
        """Queue the initial events and subscribe, atomically so that no change slips between them."""
        rt = watcher.rt
        if since == 0:
            for obj in self._select(rt, watcher.namespace, watcher.labels, watcher.fields):
                watcher.pending.append({"type": "ADDED", "object": obj})
            if initial_end:
                watcher.pending.append(self._bookmark(rt, {"k8s.io/initial-events-end": "true"}))
        elif self._history and since < self._history[0].rv - 1:
            status = KubeApiError(410, "Expired", f"too old resource version: {since} ({self._history[0].rv - 1})")
            return {"type": "ERROR", "object": status.status()}
        else:
            for event in self._history:
                if event.rv > since and event.key == rt.store_key:
                    kind = watcher.translate(event)
                    if kind:
                        watcher.pending.append({"type": kind, "object": event.obj})
        self._watchers.append(watcher)
        return None

    def _bookmark(self, rt: ResourceType, annotations: dict | None = None) -> dict:
        meta = {"resourceVersion": str(self._rv)}
        if annotations:
            meta["annotations"] = annotations
        return {"type": "BOOKMARK", "object": {"apiVersion": rt.api_version, "kind": rt.kind, "metadata": meta}}

    async def _stream(self, response: web.StreamResponse, watcher: _Watcher, timeout: int, query) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout > 0 else math.inf
        bookmarks = query.get("allowWatchBookmarks", "").lower() == "true"
        next_bookmark = loop.time() + self._bookmark_interval if bookmarks else math.inf
        while True:
            watcher.wake.clear()  # before the checks below, so a wake-up after them is never lost
            if self._stopping:
                return
            for event in _drain(watcher.pending):
                await response.write(_line(self._watch_event(watcher.rt, event)))
            now = loop.time()
            if now >= deadline:
                return
            if now >= next_bookmark:
                with self._lock:
                    # Only when nothing is queued is the current version known to be fully delivered.
                    bookmark = None if watcher.pending else self._bookmark(watcher.rt)
                if bookmark:
                    await response.write(_line(bookmark))
                next_bookmark = now + self._bookmark_interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watcher.wake.wait(), timeout=min(deadline, next_bookmark, now + 60) - now)

    def _watch_event(self, rt: ResourceType, event: dict) -> dict:
        if event["type"] in ("ERROR", "BOOKMARK"):
            return event
        return {"type": event["type"], "object": self._out(rt, event["object"])}


def _check_patch_type(content_type: str) -> None:
    if content_type not in (MERGE, JSON_PATCH, STRATEGIC):
        raise KubeApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types: {MERGE}, {JSON_PATCH}, {STRATEGIC}")


def _drain(queue: collections.deque) -> Iterator[dict]:
    while queue:
        yield queue.popleft()


def _line(event: dict) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def _spec_of(obj: dict) -> dict:
    return {key: value for key, value in obj.items() if key not in ("metadata", "status", "apiVersion", "kind")}


def _version_priority(version: str) -> tuple:
    # Kubernetes orders versions GA > beta > alpha, then by number; odd names sort last.
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (0, 0, 0)
    stability = {"alpha": 1, "beta": 2, None: 3}[match.group(2)]
    return (stability, int(match.group(1)), int(match.group(3) or 0))
