"""Keeping one vLLM engine's event stream whole: which batches to apply, when to ask for a
replay, and when the index must be cleared and rebuilt.

vLLM numbers its batches from 0 and starts again at 0 when the process restarts; its replay
socket answers `[start_seq]` with the batches it still buffers from there. Rules:
- on each connection to the PUB socket, replay from 0 (kv_bridge/bridge.py);
- the next sequence number is applied;
- one already applied is skipped (a replay overlapping what arrived live);
- a gap asks for a replay from the first missing batch (the batch itself is not applied: the
  replay brings it, in order);
- a replay that starts past the gap cannot fill it, and a live sequence number that goes back
  means the engine restarted: either way the engine's blocks are cleared and rebuilt from there;
- the last number again with other bytes is a restart too (a server killed after its first batch
  sends a new batch 0), so the sequencer keeps a digest of the last batch applied;
- a lost connection (the PUB socket's process died) clears at once: the engine's KV went with it,
  and whatever comes next, live or replayed, starts a new stream.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    apply: bool  # apply this batch's events
    clear: bool = False  # first tell the index this engine holds nothing (then rebuild)
    replay_from: int | None = None  # ask the replay socket for batches from this sequence number


APPLY, SKIP = Step(True), Step(False)


class Sequencer:
    def __init__(self) -> None:
        self.last: int | None = None  # the last batch applied
        self.digest: int | None = None  # hash() of that batch's bytes, in this process
        self.gaps = 0  # gaps seen (each asked for a replay)
        self.rebuilds = 0  # clears: restarts and replays that could not fill a gap

    def start(self) -> int:
        """Where the first replay starts."""
        return 0

    def live(self, seq: int, payload: bytes = b"") -> Step:
        """A batch from the PUB socket."""
        if self.last is not None and seq <= self.last:
            if seq == self.last and hash(payload) == self.digest:  # a replay already brought it
                return SKIP
            return self._rebuild(seq, payload, replay_from=0 if seq > 0 else None)  # the engine restarted
        return self._next(seq, payload, live=True)

    def replayed(self, seq: int, payload: bytes = b"") -> Step:
        """A batch from the replay socket (in order)."""
        if self.last is not None and seq <= self.last:
            return SKIP
        return self._next(seq, payload, live=False)

    def lost(self) -> Step:
        """The connection to the PUB socket dropped: forget the stream (and clear, if it held any)."""
        if self.last is None:
            return SKIP
        self.rebuilds += 1
        self.last = self.digest = None
        return Step(False, clear=True)

    def _next(self, seq: int, payload: bytes, live: bool) -> Step:
        expected = 0 if self.last is None else self.last + 1
        if seq == expected:
            self.last, self.digest = seq, hash(payload)
            return APPLY
        if live:  # a gap: the replay brings the missing batches and this one, in order
            self.gaps += 1
            return Step(False, replay_from=expected)
        return self._rebuild(seq, payload)  # the replay no longer holds what is missing

    def _rebuild(self, seq: int, payload: bytes, replay_from: int | None = None) -> Step:
        self.rebuilds += 1
        self.last, self.digest = seq, hash(payload)
        return Step(True, clear=True, replay_from=replay_from)
