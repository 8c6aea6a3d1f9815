"""P/D hand-offs inside the engine: a prefill engine pins its prompt's KV under a lease, a decode
engine imports those blocks and continues from the prefill's first token. The tokens equal one
engine's, only the prompt's tail runs on the decode side, and no pinned block outlives its lease.
A lease is only served for its signed handle."""

from __future__ import annotations

import asyncio

import pytest

from kvharbor.engine import SamplingParams
from kvharbor.engine.counter_board import CounterBoard
from kvharbor.engine.kv.handoff_handles import handle_lease, new_lease_key, sign_handle, unverified_request_id
from kvharbor.engine.kv.kv_handoff_link import HandoffServer, pull_handoff

PROMPT = [(i * 37) % 500 + 3 for i in range(150)]  # 9 full blocks of 16 and a 6-token tail
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(engine) -> dict:
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def prefill(llm, rid: str = "p1", prompt=PROMPT):
    """A hand-off prefill of `rid`, its lease held under the key `rid`."""
    llm.engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0),
                           hand_off=rid)  # fmt: skip
    out = run(llm.engine)[rid]
    return out.outputs[0].token_ids[0]


def hand_over(a, b, rid: str = "p1") -> int:
    n = a.engine.core.handoffs.size(rid)
    hashes, payloads = a.engine.core.handoffs.export(rid, 0, n)
    return b.engine.core.import_prefix(hashes, payloads)


def test_decode_continues_a_prefill_done_elsewhere_with_the_same_tokens(tiny_llama, make_llm):
    a, b, fresh = (make_llm(tiny_llama.loaded) for _ in range(3))
    want = fresh.generate([PROMPT], GREEDY)[0].outputs[0].token_ids

    first = prefill(a)
    assert first == want[0]
    assert a.engine.core.handoffs.size("p1") == len(PROMPT) // 16 == a.engine.core.load().kv_pinned_blocks
    assert hand_over(a, b) == 9
    b.engine.add_request("d1", prompt_token_ids=PROMPT, params=GREEDY, first_token=first)
    out = run(b.engine)["d1"]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 9 * 16  # only the tail and the first token ran here
    assert a.engine.core.handoffs.release("p1") and not a.engine.core.handoffs.release("p1")
    assert a.engine.core.load().kv_pinned_blocks == 0


def test_pinned_blocks_survive_pool_pressure_until_the_lease_ends(tiny_llama, make_llm):
    a = make_llm(tiny_llama.loaded, num_kv_blocks=32)
    prefill(a)
    pinned = a.engine.core.handoffs.export("p1", 0, 9)
    assert a.engine.core.pool.num_free == 32 - 9
    other = [(i * 13) % 500 + 3 for i in range(360)]  # 23 blocks: unpinned, one of p1's would be evicted
    a.generate([other], SamplingParams(max_tokens=2, temperature=0.0))
    assert a.engine.core.handoffs.export("p1", 0, 9) == pinned  # not evicted, not overwritten
    assert a.engine.core.handoffs.expire(now=1e12) == 1 and a.engine.core.handoffs.size("p1") is None
    assert a.engine.core.handoffs.expired == 1 and a.engine.core.load().kv_pinned_blocks == 0


def test_an_aborted_prefill_pins_nothing(tiny_llama, make_llm):
    a = make_llm(tiny_llama.loaded)
    a.engine.add_request("p1", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=1), hand_off="p1")
    a.engine.abort("p1")
    run(a.engine)
    assert a.engine.core.handoffs.num_leases == 0


def test_a_request_id_sent_again_gets_a_lease_of_its_own(tiny_llama, make_llm):
    """Clients choose request ids: a second prefill with the same id is another lease, and the
    first one's key never opens it; a key already held is refused before anything runs."""
    a = make_llm(tiny_llama.loaded)
    first, second = new_lease_key("p1"), new_lease_key("p1")
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    a.engine.add_request("p1", prompt_token_ids=PROMPT, params=greedy_one, hand_off=first)
    run(a.engine)
    with pytest.raises(ValueError, match="already held"):
        a.engine.add_request("p1", prompt_token_ids=PROMPT, params=greedy_one, hand_off=first)
    a.engine.add_request("p1", prompt_token_ids=PROMPT[:40], params=greedy_one, hand_off=second)
    run(a.engine)
    assert (a.engine.core.handoffs.size(first), a.engine.core.handoffs.size(second)) == (9, 2)
    assert a.engine.core.handoffs.size("p1") is None  # the bare request id names no lease
    assert a.engine.core.handoffs.release(first) and a.engine.core.handoffs.size(second) == 2
    assert a.engine.core.handoffs.release(second) and a.engine.core.load().kv_pinned_blocks == 0


def test_a_first_token_that_ends_the_request_finishes_it_without_a_step(tiny_llama, make_llm):
    b = make_llm(tiny_llama.loaded)
    b.engine.add_request("d1", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=1), first_token=7)
    out = run(b.engine)["d1"]
    assert out.outputs[0].token_ids == [7] and out.outputs[0].finish_reason == "length"
    b.engine.add_request("d2", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=5), first_token=2)  # EOS
    assert run(b.engine)["d2"].outputs[0].finish_reason == "stop"
    assert b.engine.core.stats.steps == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hand_off": "x#1", "params": SamplingParams(n=2)}, "one sequence"),
        ({"hand_off": True}, "non-empty string"),
        ({"hand_off": ""}, "non-empty string"),
        ({"first_token": 3, "params": SamplingParams(n=2)}, "one sequence"),
        ({"first_token": 512}, "outside the vocabulary"),
        ({"first_token": 3, "hand_off": "x#1"}, "not both"),
        ({"first_token": 3, "params": SamplingParams(logprobs=0)}, "reports no logprobs"),
    ],
)
def test_bad_handoff_requests_are_refused(tiny_llama, make_llm, kwargs, match):
    b = make_llm(tiny_llama.loaded)
    with pytest.raises(ValueError, match=match):
        b.engine.add_request("x", prompt_token_ids=PROMPT, **{"params": SamplingParams(), **kwargs})
    assert not b.engine.has_unfinished()


def test_a_handle_is_one_leases_key_signed_with_the_cores_secret():
    secret, other = b"s" * 32, b"t" * 32
    lease = new_lease_key("chatcmpl-1.a")  # a request id may hold dots: the MAC is after the last
    again = new_lease_key("chatcmpl-1.a")  # the same request id sent again: another lease
    assert lease.startswith("chatcmpl-1.a#") and again != lease
    handle = sign_handle(secret, lease)
    assert handle.startswith(lease + ".") and handle_lease(secret, handle) == lease
    assert handle_lease(secret, sign_handle(secret, again)) == again != lease
    assert unverified_request_id(handle) == "chatcmpl-1.a"  # what logs show: not the nonce, not the MAC
    from kvharbor.common.openai_api import KVTransferParams

    longest = sign_handle(secret, new_lease_key("r" * 256 + ".slot0001"))  # a client's longest id, made unique
    assert KVTransferParams(remote_host="h", remote_port=1, remote_handle=longest, first_token_id=0)
    flipped = handle[:-1] + ("1" if handle.endswith("0") else "0")  # the nonce is random: so is the MAC
    for forged in (lease, sign_handle(other, lease), flipped, handle + "0", "", handle[:-1] + "é", "x.\ud800"):
        assert handle_lease(secret, forged) is None


def test_the_hand_off_server_answers_only_a_signed_handle():
    """A real HandoffServer on 127.0.0.1 and the decode side's pull_handoff: a request id alone, or
    a handle signed by another engine, gets 'gone', and no lease is looked up or released."""
    secret = b"k" * 32
    looked_up, released = [], []

    class Leases:
        def size(self, rid):
            looked_up.append(rid)
            return 0 if rid == "p1" else None  # p1's lease holds no blocks: the pull is only head and end

    class Core:
        class handoffs:  # what HandoffServer._ask's functions read
            @staticmethod
            def release(rid):
                released.append(rid)
                return True

    async def ask(fn):
        return fn(Core)

    async def main():
        server = HandoffServer(ask, Leases(), None, "127.0.0.1", 0, CounterBoard(), secret)
        port = await server.start()
        try:
            return [await pull_handoff("127.0.0.1", port, h, None, [], 0, 10.0)
                    for h in (sign_handle(secret, "p1"), "p1", sign_handle(b"x" * 32, "p1"))]  # fmt: skip
        finally:
            await server.stop()

    signed, bare, foreign = asyncio.run(main())
    assert signed.refused is None and signed.released
    for pulled in (bare, foreign):
        assert "no such hand-off" in pulled.refused and not pulled.released
    assert looked_up == ["p1"] and released == ["p1"]
