"""The link between the API server and its engine core process: one Unix socket pair, messages of
msgpack-encoded lists, each framed by a 4-byte big-endian length.

NOTE: chosen over ZMQ (one more native dependency, and its own I/O threads on two cores) and over
multiprocessing queues (pickle per message). A message carries only ids, token ids and small
structs; the only bulk bytes are KV blocks pulled from the shared store, and those move inside the
core process. A closed socket is the other side's death: each side treats EOF as such.

    API server -> core                        core -> API server
    ["config", pickled ServeConfig] (first)   ["ready", info] (or ["failed", reason])
    ["add", EngineRequest wire]               ["added", id, imported | None, error | None,
                                                core_io.error_kind | None, field | None]
    ["lora", op, "load"|"unload", name,       ["lora_done", op, error | None, error kind | None,
     path | None]                               LoadReport json | None]
    ["abort", id] / ["abort_all"]             ["out", now, [CoreOutput wire, ...], LoadReport json,
                                                CoreStats wire]
    ["stop", id, index, n_tokens, string]     ["load", LoadReport json, CoreStats wire]
    ["reuse", prompt, cached, pulled]         ["dead", error]
    ["shutdown"]
"""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack

HEADER = struct.Struct(">I")
MAX_MESSAGE = 1 << 30


class LinkClosed(ConnectionError):
    """The other side of the link closed it (or died)."""


def encode(message: list) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def read_message_sync(sock: socket.socket) -> list:
    """The next message from a blocking socket (start-up, before an event loop owns the link);
    raises LinkClosed at EOF."""

    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = sock.recv(left)
            if not chunk:
                raise LinkClosed("the other side of the engine link closed it")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    (size,) = HEADER.unpack(exactly(HEADER.size))
    if size > MAX_MESSAGE:
        raise LinkClosed(f"a {size}-byte message on the engine link: the link is corrupt")
    return msgpack.unpackb(exactly(size), raw=False, strict_map_key=False)


async def read_message(reader: asyncio.StreamReader) -> list:
    """The next message; raises LinkClosed at EOF."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_MESSAGE:
            raise LinkClosed(f"a {size}-byte message on the engine link: the link is corrupt")
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed("the other side of the engine link closed it") from exc
    return msgpack.unpackb(body, raw=False, strict_map_key=False)
