"""The output processor on its own: token deltas from the core in, RequestOutputs with text out,
stop strings cut where they end and reported to the core; and the core's outputs on the wire."""

from __future__ import annotations

import pytest

from kvharbor.engine.core_io import CoreOutput, SampleDelta
from kvharbor.engine.output_processor import OutputProcessor, StopAt
from kvharbor.engine.request import Logprob
from kvharbor.engine.sampling_params import SamplingParams


@pytest.fixture
def tok(smollm):
    return smollm.tokenizer


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def step(proc, rid, index, new, reason=None, finished=False, stop=None):
    return proc.process([CoreOutput(rid, [SampleDelta(index, new, [], reason, stop)], finished)])


def test_a_stop_string_across_deltas_cuts_the_sample_and_tells_the_core(tok):
    proc = OutputProcessor(tok)
    proc.add("r", None, [1, 2], SamplingParams(max_tokens=50, stop=["Paris"]))
    words = ids(tok, "The capital of France is Paris. It is")
    cut = next(i for i in range(1, len(words) + 1) if "Paris" in tok.decode(words[:i]))
    outs, stops = step(proc, "r", 0, words[: cut - 1])
    assert stops == [] and not outs[0].finished and "Paris" not in outs[0].outputs[0].delta_text
    outs, stops = step(proc, "r", 0, words[cut - 1 :])  # the rest in one delta (an accepted speculated run)
    assert stops == [StopAt("r", 0, cut, "Paris")]
    (sample,) = outs[0].outputs
    assert outs[0].finished and sample.finish_reason == "stop" and sample.stop_reason == "Paris"
    assert sample.text == "The capital of France is " and sample.token_ids == words[:cut]
    assert proc.num_tracked == 0
    assert proc.process([CoreOutput("r", [SampleDelta(0, [5], [], "stop")], True)]) == ([], [])  # late: ignored


def test_a_migrated_streams_held_text_opens_the_output_and_a_straddling_stop_is_found(tok):
    """The gateway's continued_text: what the failed engine held back ("EN" of a stop "END") comes
    first, and the stop string that straddles the break ends the sample where it starts."""
    proc = OutputProcessor(tok)
    proc.add("r", None, [1], SamplingParams(max_tokens=20, stop=["END"], continued_text="EN"))
    outs, stops = step(proc, "r", 0, ids(tok, "D of it"))
    assert stops == [StopAt("r", 0, 1, "END")]
    (sample,) = outs[0].outputs
    assert sample.finish_reason == "stop" and sample.text == "" and sample.delta_text == ""

    proc.add("q", None, [1], SamplingParams(max_tokens=20, stop=["END"], continued_text="EN"))
    outs, stops = step(proc, "q", 0, ids(tok, "dless"), reason="length", finished=True)
    assert stops == [] and outs[0].outputs[0].text == "ENdless"  # no stop: the held text is handed out


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"continued_text": "x" * 1025}, "at most 1024"), ({"continued_text": "x", "n": 2}, "n = 1"),
])  # fmt: skip
def test_continued_text_is_bounded_and_for_one_sample(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_stop_string_on_the_last_allowed_token_wins_without_a_stop_command(tok):
    proc = OutputProcessor(tok)
    proc.add("r", None, [1], SamplingParams(max_tokens=3, stop=["is"]))
    outs, stops = step(proc, "r", 0, ids(tok, " This is"), reason="length", finished=True)
    assert stops == []  # the core already retired it
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == "is"


def test_eos_text_is_dropped_and_token_lists_grow_in_place(tok):
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=20, logprobs=0)
    proc.add("r", "prompt", [1], params)
    lp = [Logprob(t, -0.5, []) for t in ids(tok, "Hello")]
    first, _ = proc.process([CoreOutput("r", [SampleDelta(0, ids(tok, "Hello"), lp)], False)])
    later, _ = step(proc, "r", 0, [2], reason="stop", finished=True)  # 2 is <|im_end|>
    a, b = first[0].outputs[0], later[0].outputs[0]
    assert a.token_ids is b.token_ids  # shared, not copied every step
    assert b.text == "Hello" and b.token_ids[-1] == 2 and b.delta_token_ids == [2]
    assert later[0].prompt == "prompt" and b.logprobs == lp


def test_samples_not_forked_yet_are_reported_and_end_with_the_request(tok):
    proc = OutputProcessor(tok)
    proc.add("r", None, [1], SamplingParams(n=3, max_tokens=5))
    outs, _ = proc.process([CoreOutput("r", [SampleDelta(0, [], [], "abort")], True)])
    assert outs[0].finished and [o.finish_reason for o in outs[0].outputs] == ["abort"] * 3


def test_core_outputs_survive_the_wire():
    out = CoreOutput("r", [SampleDelta(1, [5, 6], [Logprob(5, -0.25, [(5, -0.25), (9, -2.0)])], "stop", 7)],
                     True, 32, None)  # fmt: skip
    assert CoreOutput.from_wire(out.to_wire()) == out


def test_engine_requests_cross_the_link_whole_and_through_msgpack():
    """The one typed request from the API server to EngineCore.add_request: its wire form carries
    every field (the P/D part typed too) through the link's msgpack framing, and nothing else."""
    import msgpack

    from kvharbor.engine.core_io import EngineRequest, KVTransfer

    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=["x"], logprobs=2)
    transfer = KVTransfer(remote_host="10.0.0.1", remote_port=8200, remote_handle="h", first_token_id=42)
    request = EngineRequest("r1", [1, 2, 3], params, priority=2, tenant="acme", cache_salt="s", arrival_time=5.0,
                            lora="sql", kv_prefix_source="shared", transfer=transfer,
                            external_prefix=object())  # fmt: skip
    wire = msgpack.unpackb(msgpack.packb(request.to_wire(), use_bin_type=True), raw=False)
    back = EngineRequest.from_wire(wire)
    assert back.external_prefix is None  # set in the core process, never sent
    assert back == EngineRequest(**{**request.__dict__, "external_prefix": None})
    assert (back.first_token, back.hand_off) == (42, None)
    prefill = EngineRequest.from_wire(EngineRequest("r2", [1], params, transfer=KVTransfer(True, "lease-1")).to_wire())
    assert (prefill.hand_off, prefill.first_token) == ("lease-1", None)
    with pytest.raises(TypeError):
        EngineRequest.from_wire(["r3", [1], {"no_such_field": 1}, 0, None, None, 0.0, None, None, None])


def test_params_are_validated_once_where_they_are_built_not_again_across_the_link(monkeypatch):
    params = SamplingParams(max_tokens=7, temperature=0.5, stop="x", top_k=-1, logit_bias={5: 1.0})
    wire = params.to_wire()

    def twice(self):
        raise AssertionError("validated again after the link")

    monkeypatch.setattr(SamplingParams, "validate", twice)
    back = SamplingParams.from_wire(wire)
    assert back == params and back.stop == ["x"] and back.top_k == 0  # normalized once, kept as it was
    with pytest.raises(TypeError):
        SamplingParams.from_wire({**wire, "extra": 1})
