"""One vLLM pod's KV events into the KV index: subscribe, keep the stream whole, translate, publish.

The ZMQ side follows vLLM's ZmqEventPublisher: PUB frames `(topic, seq, batch)`; the replay
socket is a ROUTER that answers a DEALER's `(b"", start_seq)` with `(b"", topic, seq, batch)`
frames and an end marker of seq -1. The Redis side is kvharbor's own (common/kv_publisher.py):
the pod's stream, its lease, and a full re-sync whenever Redis or the index asks for one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared
from kvharbor.common.kv_publisher import KVEventPublisher
from kvharbor.kv_bridge.config import BridgeOptions
from kvharbor.kv_bridge.sequencer import Sequencer, Step
from kvharbor.kv_bridge.translate import BlockSizeMismatch, Translator
from kvharbor.kv_bridge.vllm_events import MalformedBatch, decode_batch, split_frames

log = logging.getLogger("kvharbor.kv_bridge")
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0


@dataclass
class BridgeCounts:
    """What /metrics reports: nothing is dropped without a count."""

    batches: int = 0
    malformed: int = 0
    unknown_events: int = 0
    replays: int = 0


class KVBridge:
    def __init__(self, options: BridgeOptions, publisher: KVEventPublisher) -> None:
        self.options, self.publisher = options, publisher
        self.translator = Translator(options.model, options.block_size)
        self.sequencer = Sequencer()
        self.counts = BridgeCounts()
        self.refused: str | None = None  # why the pod is refused (a block size mismatch): /health says it

    async def snapshot(self) -> list[BlockHash]:
        """Every block the pod holds as far as its events said (the publisher's re-sync)."""
        self.publisher.begin_snapshot()
        return self.translator.held()

    def apply(self, payload: bytes) -> None:
        """One batch's events, translated and queued for Redis."""
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self.counts.malformed += 1
            log.warning("malformed vLLM KV event batch; skipped", extra={"error": str(exc)[:200]})
            return
        self.counts.batches += 1
        self.counts.unknown_events += batch.unknown
        events = [e for e in map(self.translator.translate, batch.events) if e is not None]
        if events:
            self.publisher.sink(events)

    def take(self, step: Step, payload: bytes | None) -> None:
        if step.clear:
            self.translator.clear()
            self.publisher.sink([AllCleared()])
            log.warning("vLLM KV events: restart or unfillable gap; the pod's index entries are rebuilt")
        if step.apply and payload is not None:
            self.apply(payload)

    async def run(self, ctx) -> None:
        """Subscribe until cancelled. Raises BlockSizeMismatch (the pod is refused)."""
        import zmq

        sub = ctx.socket(zmq.SUB)
        sub.connect(self.options.vllm_events)
        sub.setsockopt(zmq.SUBSCRIBE, self.options.vllm_topic.encode())
        try:
            await self.replay(ctx, self.sequencer.start())
            while True:
                _topic, seq, payload = split_frames(await sub.recv_multipart())
                step = self.sequencer.live(seq)
                self.take(step, payload)
                if step.replay_from is not None:
                    await self.replay(ctx, step.replay_from)
        except BlockSizeMismatch as exc:
            self.refused = str(exc)
            raise
        finally:
            sub.close(linger=0)

    async def replay(self, ctx, start: int) -> None:
        """Ask the replay socket for batches from `start`; apply what fills the stream. Without a
        replay endpoint, or when it does not answer, what is missing stays missing: the next live
        batch past it clears and rebuilds."""
        import zmq

        if self.options.vllm_replay is None:
            return
        self.counts.replays += 1
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.options.vllm_replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                _topic, seq, payload = split_frames(frames[1:])  # the DEALER's empty delimiter first
                if seq == END_SEQ:
                    return
                self.take(self.sequencer.replayed(seq), payload)
        except TimeoutError:
            log.warning("vLLM's replay socket did not answer; going on without the replay")
        finally:
            dealer.close(linger=0)
