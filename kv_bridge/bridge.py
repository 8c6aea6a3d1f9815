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
    connects: int = 0  # connections made to the PUB socket (each replays from 0)


class KVBridge:
    def __init__(self, options: BridgeOptions, publisher: KVEventPublisher) -> None:
        self.options, self.publisher = options, publisher
        self.translator = Translator(options.model, options.block_size)
        self.sequencer = Sequencer()
        self.counts = BridgeCounts()
        self.refused: str | None = None  # why the pod is refused (a block size mismatch): /health says it

    @property
    def labels(self) -> str:
        """Its metrics' labels."""
        return f'model="{self.options.model}",instance="{self.options.instance_id}"'

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
            log.warning("vLLM KV events: restart, lost socket or unfillable gap; the pod's index entries are rebuilt")
        if step.apply and payload is not None:
            self.apply(payload)

    async def run(self, ctx) -> None:
        """Subscribe until cancelled. Raises BlockSizeMismatch (the pod is refused).

        The SUB socket's monitor says when the connection is made and lost. Each new connection
        replays from 0, not just the first: batches a restarted server published before the SUB
        reconnected reach the bridge only through that replay, and a server that published once
        and then went quiet would otherwise never be seen again. A lost connection clears at once.
        """
        import zmq
        import zmq.asyncio

        sub = ctx.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.options.vllm_events)
        sub.setsockopt(zmq.SUBSCRIBE, self.options.vllm_topic.encode())
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self.connection(ctx, sub, await monitor.recv_multipart())
                if sub in ready:
                    await self.live(ctx, await sub.recv_multipart())
        except BlockSizeMismatch as exc:
            self.refused = str(exc)
            raise
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def connection(self, ctx, sub, frames: list[bytes]) -> None:
        """A monitor event: connected (replay from 0) or disconnected (clear). On a disconnect the
        batches still queued are the dead server's: they are dropped, not read as a gap each (a
        replay the dead server cannot answer, REPLAY_TIMEOUT_S apiece); the next connection's
        replay from 0 brings back any of the new server's that were among them."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.counts.connects += 1
            await self.replay(ctx, self.sequencer.start())
        elif event == zmq.EVENT_DISCONNECTED:
            log.warning("lost vLLM's KV event socket; the pod's index entries are cleared until it is back")
            while await sub.poll(0):
                await sub.recv_multipart()
            self.take(self.sequencer.lost(), None)

    async def live(self, ctx, frames: list[bytes]) -> None:
        _topic, seq, payload = split_frames(frames)
        step = self.sequencer.live(seq, payload)
        self.take(step, payload)
        if step.replay_from is not None:
            await self.replay(ctx, step.replay_from)

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
                self.take(self.sequencer.replayed(seq, payload), payload)
        except TimeoutError:
            log.warning("vLLM's replay socket did not answer; going on without the replay")
        finally:
            dealer.close(linger=0)
