"""The framing of kvharbor's engine links: msgpack-encoded lists, each framed by a 4-byte
big-endian length, over a socket. The core link (API server <-> engine core process:
engine/serve/core_client.py lists its messages) and the P/D hand-off link (engine <-> engine:
engine/kv/kv_handoff_link.py) both use it; it imports nothing of either.

NOTE: chosen over ZMQ (one more native dependency, and its own I/O threads on two cores) and over
multiprocessing queues (pickle per message). A message carries only ids, token ids and small
structs; the only bulk bytes are KV blocks. A closed socket is the other side's death: each side
treats EOF as such.
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
