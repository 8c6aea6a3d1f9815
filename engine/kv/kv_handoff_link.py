"""P/D hand-off transfers: a decode engine pulls a prefill's KV blocks straight from the prefill
engine's core process over TCP, with no Redis round trip per block (engine/README.md, Prefill/decode disaggregation).

The prefill engine's core process serves `--kv-transfer-port`; frames are engine/link_frames.py's (4-byte
length, msgpack list):

    decode -> prefill                          prefill -> decode
    ["get", handle, start]                     ["head", blocks held] | ["gone", why]
                                               ["block", block]  (one frame each)
                                               ["end"]
    ["release", handle]                        ["released", bool]

A handle is the prefill request's id signed with the core's secret (handoff_handles.py): one
that is not answers "gone", as an expired one does. Logs name the request id, never the handle.

Each block travels as the shared store's self-describing blob (kvcache_service.block_store:
model, weights fingerprint, layout, dtype, its block hash and a checksum), so the decode side
checks every block against the hash it computed from its own prompt: a block that is damaged,
for other weights or for other tokens is refused, and the run stops there. What is refused or
missing is recomputed, or fails the request (`--kv-load-failure-policy`). A decode engine that
never confirms (it died, or gave up) leaves the lease to expire on the prefill side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvharbor.common.block_hash import BlockHash
from kvharbor.engine.core_io import HandoffFailed, KVTransfer
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.kv.handoff_handles import handle_lease, unverified_request_id
from kvharbor.engine.kv.kv_handoff import HandoffLeases
from kvharbor.engine.link_frames import LinkClosed, encode, read_message
from kvharbor.kvcache_service.block_store import BlockFormat, BlockRefused, decode_block, encode_block

log = logging.getLogger("kvharbor.engine.kv.kv_handoff")
# Exported, encoded and checked 32 at a time, in worker threads: off the core process's event loop,
# which carries every stream's tokens to the API server. One frame per block: asyncio streams read
# many ~1 MB frames 2x faster than a few 20 MB ones (measured: 128 SmolLM2 blocks, 94 MB).
SLICE_BLOCKS = 32
Ask = Callable[[Callable[[Any], Any]], Awaitable[Any]]  # run fn(core) in the engine thread


# -- the prefill engine's side ------------------------------------------------------------------------


class HandoffServer:
    """Serves the core's hand-off leases to decode engines (in the core process's event loop)."""

    def __init__(
        self, ask: Ask, leases: HandoffLeases, fmt: BlockFormat, host: str, port: int, counters: CounterBoard,
        secret: bytes,
    ) -> None:
        self._ask = ask
        self._secret = secret  # signs the handles (handoff_handles.sign_handle)
        self.leases = leases  # the core's HandoffLeases: export() may run off the engine thread
        self.format = fmt
        self.host = host
        self.port = port
        self.counters = counters  # the core's
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (the one asked for, or a free one for 0)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                message = await read_message(reader)
                rid = handle_lease(self._secret, str(message[1])) if len(message) > 1 else None
                if message[0] == "get":
                    await self._send_blocks(writer, rid, int(message[2]))
                elif message[0] == "release":
                    released = rid is not None and await self._ask(lambda core, r=rid: core.handoffs.release(r))
                    writer.write(encode(["released", released]))
                else:
                    return
                await writer.drain()
        except (LinkClosed, ConnectionError, ValueError, IndexError, TypeError, KeyError, OverflowError):
            pass  # the decode side went away or spoke nonsense: the lease expires on its own
        finally:
            writer.close()

    async def _send_blocks(self, writer: asyncio.StreamWriter, handle: str | None, start: int) -> None:
        """`handle`: the lease's request id (None: the handle presented was not signed here)."""
        size = None if handle is None else self.leases.size(handle)  # a dict read: not the engine thread's
        if size is None:
            writer.write(encode(["gone", "no such hand-off here (unknown, expired or released)"]))
            return
        writer.write(encode(["head", size]))
        for first in range(max(0, start), size, SLICE_BLOCKS):
            # Not in the engine thread: a busy prefill engine's long steps would hold every slice.
            blobs = await asyncio.to_thread(self._encoded, handle, first)
            if blobs is None:
                break  # expired mid-transfer: the decode side computes the rest
            for blob in blobs:
                writer.write(encode(["block", blob]))
                await writer.drain()
            self.counters.inc("kv_handoff_sent_blocks", len(blobs))
            self.counters.inc("kv_handoff_sent_bytes", sum(map(len, blobs)))
        writer.write(encode(["end"]))

    def _encoded(self, handle: str, first: int) -> list[bytes] | None:
        got = self.leases.export(handle, first, SLICE_BLOCKS)
        if got is None:
            return None
        return [encode_block(self.format, h, p) for h, p in zip(*got, strict=True)]


# -- the decode engine's side -------------------------------------------------------------------------


@dataclass
class Pulled:
    """One hand-off pull: the verified run of payloads, and what it cost."""

    payloads: list[bytes]
    refused: str | None = None  # why the run stopped short of the prompt's blocks, if it did
    bad_block: bool = False  # a block was damaged, or for other weights or tokens
    nbytes: int = 0
    seconds: float = 0.0
    released: bool = False


async def pull_handoff(
    host: str, port: int, handle: str, fmt: BlockFormat, hashes: Sequence[BlockHash], start: int, timeout: float
) -> Pulled:
    """Blocks [start, len(hashes)) of the hand-off, checked against `hashes` (this engine's own,
    from the prompt), then the release. Stops at the first refused block. Raises OSError,
    LinkClosed or TimeoutError when the prefill engine cannot be reached or does not answer."""
    t0 = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        pulled = await asyncio.wait_for(_pull(reader, writer, handle, fmt, hashes, start), timeout)
    finally:
        writer.close()
    pulled.seconds = time.monotonic() - t0
    return pulled


async def _pull(reader, writer, handle: str, fmt: BlockFormat, hashes: Sequence[BlockHash], start: int) -> Pulled:
    writer.write(encode(["get", handle, start]))
    head = await read_message(reader)
    if head[0] != "head":
        return Pulled([], refused=str(head[1]) if len(head) > 1 else "gone")
    pulled = Pulled([])
    if head[1] < len(hashes):
        pulled.refused = f"the prefill engine holds {head[1]} of the prompt's {len(hashes)} blocks"
    blobs: list[bytes] = []
    while (message := await read_message(reader))[0] == "block":
        blobs.append(message[1])
        pulled.nbytes += len(message[1])
        if len(blobs) == SLICE_BLOCKS:
            await asyncio.to_thread(_check, pulled, fmt, hashes, start, blobs)
            blobs = []
    await asyncio.to_thread(_check, pulled, fmt, hashes, start, blobs)
    writer.write(encode(["release", handle]))
    answer = await read_message(reader)
    pulled.released = answer[0] == "released" and bool(answer[1])
    return pulled


def _check(pulled: Pulled, fmt: BlockFormat, hashes: Sequence[BlockHash], start: int, blobs: list[bytes]) -> None:
    """Append the blobs' payloads while each is the block its position in the prompt asks for."""
    for blob in blobs:
        at = start + len(pulled.payloads)
        if pulled.bad_block or at >= len(hashes):
            return  # past a refused block (or the prompt's end): use nothing after it
        try:
            pulled.payloads.append(decode_block(fmt, hashes[at], blob))
        except BlockRefused as exc:
            pulled.refused, pulled.bad_block = f"{exc.reason}: {exc}", True


class HandoffPuller:
    """The decode engine's side: turns a request's `kv_transfer_params` into an ExternalPrefix
    (engine/kv/kv_offload.py) the engine thread imports before admitting the request."""

    def __init__(self, core: Any, ask: Ask, counters: CounterBoard, policy: str, timeout: float) -> None:
        self.core = core  # read only for its constants (model, block size, block format)
        self._ask = ask
        self.counters = counters
        self.policy = policy  # recompute | fail
        self.timeout = timeout

    async def pull(
        self, prompt_ids: list[int], cache_salt: str | None, params: KVTransfer, adapter: str | None = None
    ) -> Any:
        """The prompt's blocks that are not cached here, from the prefill engine named in `params`
        (a continuation's core_io.KVTransfer).
        None when nothing is needed or nothing could be had (then the prefill is recomputed here);
        raises HandoffFailed instead when the policy is `fail`."""
        from kvharbor.common.block_hash import block_hashes
        from kvharbor.engine.kv.kv_offload import ExternalPrefix

        core = self.core
        hashes = block_hashes(prompt_ids, core.capacity.block_size, core.model_name, cache_salt, adapter)
        k = await self._ask(lambda c: c.kv.cached_run(hashes))
        host, port, handle = params.remote_host, int(params.remote_port), str(params.remote_handle)
        rid = unverified_request_id(handle)  # what logs and errors name: the handle is a capability
        try:
            got = await pull_handoff(host, port, handle, core.kv_io.format, hashes, k, self.timeout)
        except (OSError, LinkClosed, TimeoutError) as exc:
            self.counters.inc("kv_handoff_pulls", label="unreachable")
            return self._failed(f"the prefill engine at {host}:{port} did not hand over {rid!r}: {exc!r}")
        self._record(got, k, len(hashes))
        log.info("hand-off pulled", extra={"prefill_request_id": rid, "blocks": len(got.payloads), "bytes": got.nbytes,
                                           "seconds": round(got.seconds, 4), "refused": got.refused})  # fmt: skip
        await self._ask(lambda c: c.stats.record_transfer(got.nbytes, got.seconds))
        if got.refused and self.policy == "fail":
            raise HandoffFailed(f"the hand-off of {rid!r} from {host}:{port} was refused: {got.refused}")
        if got.refused:
            log.warning("hand-off KV refused; recomputing the rest",
                        extra={"prefill_request_id": rid, "why": got.refused})  # fmt: skip
        if not got.payloads:
            return None
        return ExternalPrefix(hashes[:k], hashes[k : k + len(got.payloads)], got.payloads)

    def _record(self, got: Pulled, cached: int, wanted: int) -> None:
        complete = cached + len(got.payloads) == wanted
        self.counters.inc("kv_handoff_pulls", label="refused" if got.bad_block else "ok" if complete else "partial")
        self.counters.inc("kv_handoff_pulled_bytes", got.nbytes)
        self.counters.inc("kv_handoff_pull_seconds", got.seconds)

    def _failed(self, why: str) -> None:
        if self.policy == "fail":
            raise HandoffFailed(why)
        log.warning("%s; recomputing the prefill here", why)
        return None
