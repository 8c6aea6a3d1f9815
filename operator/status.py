"""Status conditions, phase and events of an InferenceService, as pure functions.

A condition's lastTransitionTime moves only when its status changes, so a reconcile that finds
nothing new writes the same status again (and the API server skips the no-op write). Every
transition also becomes an event, which is how `kubectl describe` tells the story.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CONDITION_TYPES = ("Ready", "Placed", "Progressing", "Degraded")


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    """What one handler call decided: fields to merge into .status, and events to post."""

    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


def rfc3339(epoch: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if epoch is None else epoch))


def parse_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def set_condition(
    conditions: Sequence[dict], type_: str, status: bool, reason: str, message: str, now: str
) -> list[dict]:
    """`conditions` with `type_` set; its lastTransitionTime is kept unless the status flips."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime", now) if old and old.get("status") == value else now
    new = {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": since}
    rest = [c for c in conditions if c.get("type") != type_]
    return sorted([*rest, new], key=lambda c: CONDITION_TYPES.index(c["type"]) if c["type"] in CONDITION_TYPES else 99)


def condition(conditions: Sequence[dict], type_: str) -> dict | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: Sequence[dict], type_: str) -> bool:
    found = condition(conditions, type_)
    return bool(found) and found.get("status") == "True"


def phase(conditions: Sequence[dict]) -> str:
    placed = condition(conditions, "Placed")
    if placed and placed.get("status") == "False":
        return "Unplaceable"
    if is_true(conditions, "Degraded"):
        return "Degraded"
    if is_true(conditions, "Progressing"):
        return "Progressing"
    if is_true(conditions, "Ready"):
        return "Ready"
    return "Pending"


def transition_events(old: Sequence[dict], new: Sequence[dict]) -> list[Event]:
    """One event per condition whose status or reason changed."""
    events = []
    for cond in new:
        before = condition(old, cond["type"])
        if before and (before.get("status"), before.get("reason")) == (cond["status"], cond.get("reason")):
            continue
        warning = (cond["type"], cond["status"]) in (("Degraded", "True"), ("Placed", "False"))
        message = f"{cond['type']}={cond['status']}: {cond.get('message', '')}"
        events.append(Event("Warning" if warning else "Normal", cond.get("reason") or cond["type"], message))
    return events


def event_manifest(obj: dict, event: Event, component: str = "kvharbor-operator") -> dict:
    """A core/v1 Event about `obj`, for posting outside a kopf handler (kopf.event needs one)."""
    meta = obj["metadata"]
    now = rfc3339()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "kvharbor-", "namespace": meta.get("namespace") or "default"},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "source": {"component": component},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
