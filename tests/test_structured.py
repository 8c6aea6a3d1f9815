"""Structured outputs in the engine (engine/structured/): every finished output of a constrained
request parses and validates against its schema, regex or choices; n > 1 samples, stop strings and
max_tokens work with a grammar; constrained rows leave the unconstrained rows of their batch alone;
and every bad spec is a ValueError naming the problem. The real SmolLM2, in-process."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvharbor.common.request_limits import RequestLimits
from kvharbor.engine import SamplingParams
from kvharbor.engine.structured.grammar import GrammarError, grammar_for

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and city."}]


def _json(spec):
    return {"kind": "json", "value": spec}


@pytest.fixture(scope="module")
def llm(smollm):
    from kvharbor.engine import LLM

    return LLM(loaded_model=smollm, dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


def _texts(llm, messages, params):
    return [(o.text, o.finish_reason) for o in llm.chat(messages, params)[0].outputs]


def test_a_json_schema_request_gives_json_that_validates_greedy_and_sampled(llm):
    for params in (
        SamplingParams(max_tokens=80, temperature=0, structured=_json(PERSON)),
        SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=3, structured=_json(PERSON)),
    ):
        outs = _texts(llm, ASK, params)
        assert len(outs) == params.n
        for text, finish in outs:
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), PERSON)


def test_min_tokens_past_a_complete_grammar_ends_it_valid(llm):
    """Issue 47, item 2: min_tokens masked EOS after the grammar allowed only EOS, so the row was
    all -inf: greedy took token 0 and sampling drew from the whole vocabulary, after valid JSON.
    The grammar decides: the answer ends where its structure does, min_tokens or not."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}  # fmt: skip
    for params in (
        SamplingParams(max_tokens=40, min_tokens=30, temperature=0, structured=_json(small)),
        SamplingParams(max_tokens=40, min_tokens=30, temperature=1.0, seed=5, n=3, structured=_json(small)),
        SamplingParams(max_tokens=40, min_tokens=30, temperature=0, structured={"kind": "choice", "value": ["yes"]}),
    ):
        for text, finish in _texts(llm, ASK, params):
            assert finish == "stop", text
            assert text == "yes" or json.loads(text) in ({"ok": True}, {"ok": False}), text


def test_choice_and_regex_outputs_are_exactly_what_was_allowed(llm):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    choice = {"kind": "choice", "value": ["Paris", "London"]}
    ((text, finish),) = _texts(llm, ask, SamplingParams(max_tokens=8, temperature=0, structured=choice))
    assert text in ("Paris", "London") and finish == "stop"
    phone = [{"role": "user", "content": "Give me a phone number."}]
    spec = {"kind": "regex", "value": r"\d{3}-\d{4}"}
    ((text, finish),) = _texts(llm, phone, SamplingParams(max_tokens=12, temperature=0, structured=spec))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) and finish == "stop"  # ASCII digits: not Unicode's


def test_a_lark_and_an_ebnf_grammar_constrain_alike(llm):
    ask = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]
    for grammar in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        spec = {"kind": "grammar", "value": grammar}
        ((text, finish),) = _texts(llm, ask, SamplingParams(max_tokens=4, temperature=0, structured=spec))
        assert text in ("yes", "no") and finish == "stop"


def test_max_tokens_and_stop_strings_still_end_a_constrained_output(llm):
    ((text, finish),) = _texts(llm, ASK, SamplingParams(max_tokens=5, temperature=0, structured=_json(PERSON)))
    assert finish == "length" and text.startswith('{"name"')
    ((text, finish),) = _texts(llm, ASK, SamplingParams(max_tokens=80, temperature=0, stop=['"age"'],
                                                      structured=_json(PERSON)))  # fmt: skip
    assert finish == "stop" and text.endswith(",") and '"age"' not in text


def test_constrained_rows_leave_the_unconstrained_ones_of_their_batch_alone(llm):
    """float32: an unconstrained request is token-identical with and without constrained ones."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[{"role": "user", "content": "What is the capital of France?"}], ASK]
    alone = [o.outputs[0].token_ids for o in llm.chat(prompts, free)]
    mixed = llm.chat(prompts * 2, [free, free, SamplingParams(max_tokens=60, temperature=0, structured=_json(PERSON)),
                                   SamplingParams(max_tokens=8, temperature=0,
                                                  structured={"kind": "choice", "value": ["a", "b"]})])  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), PERSON)
    assert mixed[3].outputs[0].text in ("a", "b")


BAD_SPECS = [
    ({"kind": "json", "value": {"type": "strin"}}, "strin"),
    ({"kind": "json", "value": {"type": "object", "not": {}}}, "not"),
    ({"kind": "regex", "value": "[a-z"}, "unclosed character class"),
    ({"kind": "grammar", "value": "start: nothing_defined"}, "nothing_defined"),
    ({"kind": "choice", "value": []}, "non-empty list"),
    ({"kind": "json", "value": {"description": "x" * 70000}}, "structured_max_bytes"),
    ({"kind": "json", "value": json.loads('{"items":' * 40 + "{}" + "}" * 40)}, "structured_max_depth"),
]


@pytest.mark.parametrize(("spec", "says"), BAD_SPECS, ids=[s[1] for s in BAD_SPECS])
def test_a_bad_spec_is_a_value_error_naming_the_problem_and_queues_nothing(llm, spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.engine.add_request("bad", None, SamplingParams(max_tokens=4, structured=spec), prompt_token_ids=[1, 2])
    assert not llm.engine.has_unfinished()


def test_compiled_grammars_are_cached_by_spec(llm):
    compiles = llm.engine.core.board.values["structured_compiles"]  # the core counts each lookup
    seen = []
    spec = _json({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})
    for _ in range(2):
        before = dict(compiles)
        llm.chat(ASK, SamplingParams(max_tokens=12, temperature=0, structured=spec))
        seen += [label == "hit" for label in compiles if compiles[label] != before.get(label, 0)]
    assert seen == [False, True]


def test_limits_are_checked_before_any_compile():
    small = RequestLimits(structured_max_bytes=64, structured_max_depth=2)
    with pytest.raises(GrammarError, match="structured_max_bytes"):
        grammar_for({"kind": "regex", "value": "a" * 65}, small)
    with pytest.raises(GrammarError, match="structured_max_depth"):
        grammar_for(_json({"type": "object", "properties": {"a": {"type": "object"}}}), small)


# -- property: schemas built from JSON Schema's features -------------------------------------------

_LEAVES = st.sampled_from([
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 50},
    {"type": "string", "maxLength": 12},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "string", "pattern": "^[a-z]{2,6}$"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
])  # fmt: skip


def _object(children):
    return st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            }
        )
    )


def _array(item, least):
    return {"type": "array", "items": item, "minItems": least, "maxItems": least + 2}


_SCHEMAS = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        _object(children),
        st.builds(_array, children, st.integers(0, 2)),
    ),
    max_leaves=4,
).filter(lambda s: s.get("type") == "object")


@pytest.mark.slow  # 12 generations: ~13 s here
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, seed=st.integers(0, 2**16))
def test_every_finished_output_validates_against_its_generated_schema(llm, schema, seed):
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=seed, structured=_json(schema))
    ((text, finish),) = _texts(llm, ASK, params)
    event(f"finish: {finish}")  # --hypothesis-show-statistics: how many finished
    if finish == "stop":  # cut by max_tokens: not finished, and not held to the schema
        jsonschema.validate(json.loads(text), schema)


def test_a_migrated_stream_continues_its_structure_where_the_last_engine_left_it(llm, smollm):
    """The gateway moves a broken stream with its output so far at the prompt's end and
    continued_tokens saying how long it is: the grammar walks those tokens first, so the new
    engine's tokens finish the same JSON (greedy, float32: token for token)."""
    prompt = smollm.tokenizer.encode_chat(ASK)
    params = dict(max_tokens=80, temperature=0, structured=_json(PERSON))
    whole = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))[0].outputs[0].token_ids
    cut = 6
    resumed = llm.generate([{"prompt_token_ids": prompt + whole[:cut]}],
                           SamplingParams(**{**params, "max_tokens": 80 - cut}, continued_tokens=cut))  # fmt: skip
    assert whole[:cut] + resumed[0].outputs[0].token_ids == whole
    not_json = prompt + smollm.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not follow"):  # output that the grammar cannot have made
        llm.engine.add_request("bad", None, SamplingParams(**params, continued_tokens=2), prompt_token_ids=not_json)
    assert not llm.engine.has_unfinished()


def test_chunked_prefill_and_preemption_keep_each_grammar_on_its_path(make_llm, smollm):
    """A pool too small for the batch preempts (and recomputes) requests mid-JSON, and the prompts
    prefill in chunks of 32 tokens: every output validates, and is the one it is alone."""
    llm = make_llm(smollm, num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=32, max_num_seqs=4)
    asks = [[{"role": "user", "content": f"Describe {who} as JSON." + " Keep it short." * k}]
            for who, k in (("a baker", 0), ("a pilot", 3), ("a doctor", 6), ("a farmer", 9))]  # fmt: skip
    params = SamplingParams(max_tokens=60, temperature=0, structured=_json(PERSON))
    alone = [llm.chat(m, params)[0].outputs[0].text for m in asks]
    assert llm.engine.core.scheduler.num_preemptions == 0
    outs = llm.chat(asks, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == alone
    for text in alone:
        jsonschema.validate(json.loads(text), PERSON)


def test_an_engine_that_speculates_leaves_guided_rows_to_plain_decoding(make_llm, smollm, caplog):
    llm = make_llm(smollm, speculative_method="ngram", speculative_k=3)
    params = SamplingParams(max_tokens=60, temperature=0, structured=_json(PERSON))
    with caplog.at_level("INFO", logger="kvharbor.engine"):
        ((text, finish),) = _texts(llm, ASK, params)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert llm.engine.core.stats.spec_proposed == 0  # no proposal for the only (guided) request
    assert any("speculative decoding skips structured-output" in r.message for r in caplog.records)


def test_lora_rows_are_constrained_like_base_rows_in_one_batch(make_llm, smollm, tmp_path):
    from lora_adapters import write_random_adapter

    adapter = write_random_adapter(tmp_path / "sql", smollm.arch, 8, seed=1)
    llm = make_llm(smollm, lora=[f"sql={adapter}"], kv_cache_memory="512MiB", max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=60, temperature=0, structured=_json(PERSON))
    prompt = smollm.tokenizer.encode_chat(ASK)
    for name in ("a", "b"):
        llm.engine.add_request(name, None, params, prompt_token_ids=prompt, lora="sql" if name == "a" else None)
    outs = {}
    while llm.engine.has_unfinished():
        outs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert sorted(outs) == ["a", "b"]
    for out in outs.values():
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
