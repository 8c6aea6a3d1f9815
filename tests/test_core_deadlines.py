"""Issue 47, item 8: no wait on the core link without an answer or a deadline. The core process
answers every add, whatever fails while it takes the request; the API server gives up on an add
the core does not answer within core_add_timeout (a 504), aborting it in the core; a grammar that
does not compile in time is the request's 400."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack
import pytest

from kvharbor.engine.core_io import EngineError, EngineRequest, StructuredOutputError
from kvharbor.engine.link_frames import HEADER, encode
from kvharbor.engine.sampling_params import SamplingParams
from kvharbor.engine.serve.core_client import CoreClient, CoreStalled
from kvharbor.engine.serve.core_process import CoreProcess


def _core_process(core) -> tuple[CoreProcess, list]:
    proc = CoreProcess.__new__(CoreProcess)
    sent: list = []
    proc.core, proc._pending, proc._send = core, {}, sent.append
    return proc, sent


def _request(rid: str = "r1", **params) -> EngineRequest:
    return EngineRequest(rid, [5, 6, 7], SamplingParams(max_tokens=4, **params))


def test_an_unexpected_failure_while_taking_a_request_is_answered():
    class Broken:
        def adapter_identity(self, lora):
            raise KeyError("a bug the core did not expect")

    proc, sent = _core_process(Broken())
    wire = _request().to_wire()
    proc._pending["r1"] = False
    asyncio.run(proc._add(wire))
    ((kind, rid, imported, message, error_kind, _field),) = sent
    assert (kind, rid, imported, error_kind) == ("added", "r1", None, "internal")
    assert "KeyError" in message and "r1" not in proc._pending


def test_a_grammar_that_compiles_too_slowly_is_the_requests_400():
    import time

    class SlowGuides:
        def guide(self, spec):
            time.sleep(0.5)

    core = SimpleNamespace(
        guides=SlowGuides(), config=SimpleNamespace(structured=SimpleNamespace(structured_compile_timeout=0.05)),
        adapter_identity=lambda lora: None,
    )  # fmt: skip
    proc, sent = _core_process(core)
    proc.board = SimpleNamespace(inc=lambda *a, **k: None)
    wire = _request(structured={"kind": "regex", "value": "a+"}).to_wire()
    asyncio.run(proc._add(wire))
    ((_kind, _rid, _imported, message, error_kind, _field),) = sent
    assert error_kind == "structured" and "did not compile within 0.05 s" in message


def test_an_add_the_core_never_answers_times_out_and_is_aborted():
    client = CoreClient.__new__(CoreClient)
    written: list[bytes] = []
    client.config = SimpleNamespace(server=SimpleNamespace(core_add_timeout=0.1))
    client.proc = SimpleNamespace(poll=lambda: None)
    client.error, client._streams, client._added, client._waiting = None, {}, {}, {}
    client._writer = SimpleNamespace(is_closing=lambda: False, write=written.append)
    client.processor = SimpleNamespace(add=lambda *a: None, forget=lambda rid: None)

    async def main():
        with pytest.raises(CoreStalled, match=r"within 0\.1 s"):
            await client.add(_request())

    asyncio.run(main())
    messages = [msgpack.unpackb(frame[HEADER.size :]) for frame in written]
    assert [m[0] for m in messages] == ["add", "abort"] and messages[1][1] == "r1"
    assert not client._streams and not client._added  # nothing left waiting


def test_the_internal_kind_raises_the_engine_error_again():
    from kvharbor.engine.serve.core_client import _settle

    async def main():
        done = asyncio.get_running_loop().create_future()
        _settle(done, None, "boom", "internal")
        with pytest.raises(EngineError, match="boom"):
            await done

    asyncio.run(main())
    assert not issubclass(EngineError, ValueError) and issubclass(StructuredOutputError, ValueError)
    assert msgpack.unpackb(encode(["x"])[HEADER.size :]) == ["x"]  # the framing the tests above read
