"""KVEventPublisher: an instance's KV events, written to its Redis Stream (torch-free: the engine's
core process and the vLLM KV bridge both publish through it).

    stream    <prefix>{<model>:<instance>}        XADD, one entry per event (kvharbor.common.kv_events)
    registry  <prefix>streams                     HSET stream -> model, instance (on every re-sync)
    resync    <prefix>resync                      GET each heartbeat: when it moved, re-sync
    lease     kvharbor:lease:{<model>:<instance>} the lease id, refreshed every ttl/3 (PX ttl)

Key names come from kvharbor.common.redis_keys; a redis+cluster:// URL writes to a Redis Cluster.
One stream per instance lets several KV cache service replicas share the intake.

On every (re)connect it writes `cleared` and then everything the instance holds (its `snapshot`,
which calls `begin_snapshot` where the events come from), so an index that lost
its state, or missed events while Redis was away, is rebuilt. It does the same when the resync
counter moves: on a Redis Cluster one node can restart empty while this engine's own keys, on
another node, never noticed. While Redis is down the engine keeps
serving: events are dropped and counted, and the publisher retries with exponential backoff.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable

from kvharbor.common.block_hash import BlockHash
from kvharbor.common.kv_events import AllCleared, BlockStored, EventEnvelope, KVEvent, to_fields
from kvharbor.common.redis_client import connect
from kvharbor.common.redis_keys import lease_key, registry_value, resync_key, stream_key, stream_registry_key

Snapshot = Callable[[], Awaitable[list[BlockHash]]]  # every block the instance holds, now

log = logging.getLogger("kvharbor.engine.kv_events")

# Delete the lease key only if it still holds our lease (a restarted process may own it now).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLapsed(RuntimeError):
    """Our lease key had expired (a long stall): the index may have swept us, so re-sync."""


class ResyncRequested(RuntimeError):
    """The KV cache service lost part of the index (a cluster node came back empty): re-sync."""


RESYNC_BATCH = 256
MAX_BACKOFF = 10.0


class KVEventPublisher:
    def __init__(
        self,
        redis_url: str,
        model: str,
        instance: str,
        stream_prefix: str,
        lease_ttl: float,
        on_published: Callable[[int], None] = lambda n: None,
        on_dropped: Callable[[int], None] = lambda n: None,
        max_queue: int = 100_000,
    ) -> None:
        self.redis_url = redis_url
        self.model = model
        self.instance = instance
        self.stream_prefix = stream_prefix
        self.stream_key = stream_key(model, instance, stream_prefix)
        self.lease_ttl = lease_ttl
        self.lease = uuid.uuid4().hex
        self._on_published = on_published
        self._on_dropped = on_dropped
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._queue: collections.deque[KVEvent] = collections.deque()
        self._connected = False
        self._seq = 0
        self._stopping = asyncio.Event()
        self.published = 0
        self.dropped = 0
        self.resyncs = 0
        self._resync_seen: bytes | None = None  # the resync counter when we last re-published

    # -- where the events come from (the engine thread, or the bridge's loop) ----------------------

    def sink(self, events: list[KVEvent]) -> None:
        """Take the instance's events (any thread). Dropped, and counted, while Redis is away."""
        with self._lock:
            if not self._connected or len(self._queue) + len(events) > self._max_queue:
                self._drop(len(events))
                return
            self._queue.extend(events)

    def begin_snapshot(self) -> None:
        """Called by the snapshot where the events come from, in the same breath as it reads the
        full set: everything queued so far is superseded by it, so drop it and count from here."""
        with self._lock:
            self._queue.clear()
            self._connected = True

    def _drop(self, n: int) -> None:
        self.dropped += n
        self._on_dropped(n)

    # -- the event loop ---------------------------------------------------------------------------

    async def run(self, snapshot: Snapshot, block_size: int) -> None:
        """Publish until `stop()`; reconnects with backoff; never raises for Redis trouble."""
        from redis.exceptions import RedisClusterException, RedisError

        backoff = 0.5
        while not self._stopping.is_set():
            client = connect(self.redis_url, timeout=3)
            try:
                await client.ping()
                await self._resync(client, snapshot, block_size)
                log.info("publishing KV events", extra={"stream": self.stream_key, "lease": self.lease})
                backoff = 0.5
                await self._pump(client)
            except LeaseLapsed:
                self._disconnect()
                log.warning("KV event lease lapsed; re-publishing everything this engine holds")
            except ResyncRequested:
                self._disconnect()
                log.warning("the KV index asked for a re-sync; re-publishing everything this engine holds")
            except (RedisError, RedisClusterException, OSError) as exc:
                self._disconnect()
                log.warning("Redis unavailable for KV events; retrying in %.1fs", backoff, extra={"error": repr(exc)})
                await self._sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            finally:
                await client.aclose()

    async def _resync(self, client, snapshot: Snapshot, block_size: int) -> None:
        hashes = await snapshot()
        events: list[KVEvent] = [AllCleared()]
        for i in range(0, len(hashes), RESYNC_BATCH):
            # NOTE: a re-sync sends the set of held blocks; its batches are not chains (parent None).
            events.append(BlockStored(hashes=tuple(hashes[i : i + RESYNC_BATCH]), parent=None, block_size=block_size))
        self._resync_seen = await client.get(resync_key(self.stream_prefix))
        await self._heartbeat(client)
        registry = stream_registry_key(self.stream_prefix)
        await client.hset(registry, self.stream_key, registry_value(self.model, self.instance))
        await self._write(client, events)
        self.resyncs += 1

    async def _pump(self, client) -> None:
        next_beat = asyncio.get_running_loop().time() + self.lease_ttl / 3
        while not self._stopping.is_set():
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(512, len(self._queue)))]
            if batch:
                try:
                    await self._write(client, batch)
                except BaseException:
                    self._drop(len(batch))  # taken off the queue, never written
                    raise
            now = asyncio.get_running_loop().time()
            if now >= next_beat:
                if not await self._heartbeat(client):
                    raise LeaseLapsed(self.lease)
                if await client.get(resync_key(self.stream_prefix)) != self._resync_seen:
                    raise ResyncRequested(self.lease)
                next_beat = now + self.lease_ttl / 3
            if not batch:
                await self._sleep(0.02)

    async def _write(self, client, events: list[KVEvent]) -> None:
        pipe = client.pipeline(transaction=False)
        for event in events:
            self._seq += 1
            envelope = EventEnvelope(event, self.instance, self.model, self.lease, self._seq)
            pipe.xadd(self.stream_key, to_fields(envelope), maxlen=1_000_000, approximate=True)
        await pipe.execute()
        self.published += len(events)
        self._on_published(len(events))

    async def _heartbeat(self, client) -> bool:
        """Renew the lease; False when it had lapsed (or was taken) before this renewal."""
        old = await client.set(
            lease_key(self.model, self.instance), self.lease, px=int(self.lease_ttl * 1000), get=True
        )
        return old is not None and (old.decode() if isinstance(old, bytes) else old) == self.lease

    def _disconnect(self) -> None:
        with self._lock:
            lost = len(self._queue)
            self._queue.clear()
            self._connected = False
        if lost:
            self._drop(lost)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def stop(self) -> None:
        """Stop publishing; tell the index this instance holds nothing any more (best effort)."""
        self._stopping.set()
        from redis.exceptions import RedisClusterException, RedisError

        client = connect(self.redis_url, timeout=1)
        try:
            await self._write(client, [AllCleared()])
            await client.eval(_RELEASE, 1, lease_key(self.model, self.instance), self.lease)
        except (RedisError, RedisClusterException, OSError):
            pass
        finally:
            await client.aclose()
