"""Scheduler, without a model: budgets, chunked prefill, priorities, fairness, preemption, abort."""

from kvharbor.common.block_hash import namespace_hash
from kvharbor.engine.config import SchedulerConfig
from kvharbor.engine.kv.block_pool import BlockPool
from kvharbor.engine.kv.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import FinishReason, Request, RequestStatus
from kvharbor.engine.sampling_params import SamplingParams
from kvharbor.engine.scheduler import Scheduler, SchedulerPlan, StepOutput

BS = 4
EOS = 2


def make(num_blocks=32, budget=64, max_seqs=8):
    kv = KVCacheManager(BlockPool(num_blocks, BS))
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, kv, max_model_len=256, eos_token_ids=frozenset({EOS})), kv


def req(rid, n_prompt, max_tokens=4, priority=0, tenant=None, arrival=0.0, start=10, **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw)
    tokens = list(range(start, start + n_prompt))
    return Request(
        rid, tokens, params, max_tokens, namespace_hash("m"), priority=priority, tenant=tenant, arrival_time=arrival
    )


def step(s: Scheduler, token=7) -> SchedulerPlan:
    plan = s.schedule()
    out = StepOutput()
    for c in plan.chunks:
        if c.num_samples:
            out.tokens[c.request.request_id] = [token] * c.num_samples
    s.update(plan, out)
    return plan


def shape(plan: SchedulerPlan):
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


def test_chunked_prefill_under_one_budget_with_decodes_first():
    s, kv = make(budget=8)
    s.add(req("a", 10))
    assert shape(step(s)) == [("a", 0, 8)]
    s.add(req("b", 6, arrival=1.0, start=100))
    assert shape(step(s)) == [("a", 8, 2), ("b", 0, 6)]  # a finishes its prompt and samples
    assert shape(step(s)) == [("a", 10, 1), ("b", 6, 1)]  # both decode
    kv.check_integrity()


def test_a_waiting_request_starts_after_its_cached_prefix():
    s, _ = make(budget=8)
    s.add(req("a", 10))
    step(s)
    s.add(req("b", 6, arrival=1.0))  # shares a's first block (tokens 10..13)
    assert shape(step(s)) == [("a", 8, 2), ("b", 4, 2)]
    assert s.requests["b"].num_cached_tokens == 4


def test_requests_finish_on_max_tokens_eos_and_stop_ids_and_free_blocks():
    s, kv = make()
    s.add(req("len", 4, max_tokens=2))
    s.add(req("eos", 4, start=50))
    s.add(req("stopid", 4, start=90, stop_token_ids=[7]))
    step(s, token=3)
    assert len(s.running) == 3
    plan = s.schedule()
    s.update(plan, StepOutput(tokens={"len": [3], "eos": [EOS], "stopid": [7]}))
    assert s.num_unfinished == 0
    reasons = {c.request.request_id: (c.request.finish_reason, c.request.stop_reason) for c in plan.chunks}
    assert reasons == {
        "len": (FinishReason.LENGTH, None),
        "eos": (FinishReason.STOP, None),
        "stopid": (FinishReason.STOP, 7),
    }
    kv.check_integrity()
    assert kv.pool.num_free == kv.pool.num_blocks


def test_min_tokens_and_ignore_eos_hold_back_eos():
    s, _ = make()
    s.add(req("a", 4, max_tokens=5, min_tokens=2))
    s.add(req("b", 4, max_tokens=5, start=40, ignore_eos=True))
    step(s, token=EOS)  # first token: below min_tokens for a; ignored for b
    assert {r.request_id for r in s.running} == {"a", "b"}
    step(s, token=EOS)
    assert [r.request_id for r in s.running] == ["b"]


def test_higher_priority_first_then_fair_across_tenants():
    s, _ = make(budget=4 * 3, max_seqs=3)
    s.add(req("low", 4, priority=-1, arrival=0.0))
    s.add(req("t1-a", 4, tenant="t1", arrival=1.0, start=100))
    s.add(req("t1-b", 4, tenant="t1", arrival=2.0, start=200))
    s.add(req("t2-a", 4, tenant="t2", arrival=3.0, start=300))
    plan = step(s)
    # Priority 0 before -1; t2's first request before t1's second one.
    assert [c.request.request_id for c in plan.chunks] == ["t1-a", "t2-a", "t1-b"]


def test_out_of_blocks_preempts_the_lowest_priority_and_recomputes_it():
    s, kv = make(num_blocks=4, budget=64)
    s.add(req("keep", 7, max_tokens=8, priority=1))
    s.add(req("victim", 7, max_tokens=8, start=50, arrival=1.0))
    step(s)  # both prefill: 2 blocks each, pool full
    step(s)  # position 7 still fits in each second block
    plan = step(s)  # "keep" needs a third block: "victim" is preempted
    assert [r.request_id for r in plan.preempted] == ["victim"]
    victim = s.requests["victim"]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.output_token_ids == [7, 7]  # kept: recomputed later, not resampled
    kv.check_integrity()
    while s.num_unfinished:
        step(s)
    assert victim.num_preemptions >= 1 and len(victim.output_token_ids) == 8
    kv.check_integrity()
    assert kv.pool.num_free == kv.pool.num_blocks


def test_a_higher_priority_arrival_preempts_when_the_batch_is_full():
    s, kv = make(max_seqs=1)
    s.add(req("bulk", 4, max_tokens=8, priority=-1))
    step(s)
    s.add(req("urgent", 4, max_tokens=8, priority=5, start=60, arrival=1.0))
    plan = step(s)
    assert [r.request_id for r in plan.preempted] == ["bulk"]
    assert [c.request.request_id for c in plan.chunks] == ["urgent"]
    kv.check_integrity()


def test_abort_frees_blocks_at_once_whatever_the_state():
    s, kv = make(budget=4)
    s.add(req("running", 4))
    s.add(req("waiting", 8, start=70))
    step(s)
    s.finish(s.requests["running"], FinishReason.ABORT)
    s.finish(s.requests["waiting"], FinishReason.ABORT)
    assert s.num_unfinished == 0 and kv.pool.num_free == kv.pool.num_blocks
    kv.check_integrity()


def test_fork_creates_n_samples_sharing_the_prompt():
    s, kv = make()
    s.add(req("g", 6, max_tokens=3, n=3))
    plan = s.schedule()
    assert plan.chunks[0].num_samples == 3
    forked = s.update(plan, StepOutput(tokens={"g": [7, 8, 9]}))
    assert [c.request_id for c in forked] == ["g\x1f1", "g\x1f2"]
    assert [r.output_token_ids for r in (s.requests["g"], *forked)] == [[7], [8], [9]]
    assert kv.block_ids(forked[0]) == kv.block_ids(s.requests["g"])
    plan = step(s)
    assert len(plan.block_copies) == 2  # two of three samples copy the shared partial block
    kv.check_integrity()


def test_priority_preemption_only_when_the_newcomer_could_run_this_step():
    s, _ = make(num_blocks=64, budget=8, max_seqs=2)
    s.add(req("L", 3, max_tokens=50, priority=0))
    step(s)
    step(s)
    s.add(req("H", 60, max_tokens=4, priority=2, arrival=1.0, start=100))
    step(s)  # H prefills in chunks that eat the whole budget
    s.add(req("W", 5, max_tokens=4, priority=1, arrival=2.0, start=200))
    for _ in range(4):
        plan = step(s)
        # W outranks L, but H leaves no budget for W: evicting L would only waste its work.
        assert not plan.preempted
    assert s.requests["L"].num_preemptions == 0


def test_prefix_hit_counters_count_each_admission_once():
    s, kv = make(num_blocks=4, budget=64)
    s.add(req("a", 12, max_tokens=4))  # 16 tokens: the whole pool
    step(s)
    s.add(req("b", 12, max_tokens=2, start=100, arrival=1.0))
    while "a" in s.requests:
        step(s)  # b is looked up, and refused, on every one of these steps
    while s.num_unfinished:
        step(s)
    assert kv.prefix_queries == 12 + 12


def test_speculation_uses_only_what_real_work_left():
    """Three decodes that exactly fill a 9-block pool: a guess for the first must not take the
    block another needs (which would preempt it); with budget and blocks to spare it runs."""
    from kvharbor.engine.spec.proposers import Proposal

    s, kv = make(num_blocks=9, budget=64, max_seqs=8)
    for i, rid in enumerate("abc"):
        s.add(req(rid, 8, max_tokens=8, arrival=float(i), start=10 + 20 * i))
    step(s)  # prefill: 2 full blocks each, and 1 sampled token that needs a third block to run
    plan = s.schedule({"a": Proposal([1, 2, 3, 4, 5])})  # 5 guesses would need a fourth block
    assert plan.preempted == [] and shape(plan) == [("a", 8, 1), ("b", 8, 1), ("c", 8, 1)]
    assert not plan.chunks[0].draft
    kv.check_integrity()

    s2, kv2 = make(num_blocks=12, budget=64)
    for i, rid in enumerate("abc"):
        s2.add(req(rid, 7, max_tokens=8, arrival=float(i), start=10 + 20 * i))
    step(s2)
    plan2 = s2.schedule({"a": Proposal([1, 2, 3])})
    assert shape(plan2) == [("a", 7, 4), ("b", 7, 1), ("c", 7, 1)] and plan2.chunks[0].draft == [1, 2, 3]
    out = StepOutput(tokens={"a": [1, 9], "b": [7], "c": [7]})  # a: one guess accepted, then 9
    s2.update(plan2, out)
    a = next(r for r in s2.running if r.request_id == "a")
    assert a.output_token_ids == [7, 1, 9] and a.num_computed_tokens == 9  # the last token and the guess
    assert len(kv2.tables["a"]) == 3  # blocks for the 9 kept tokens; the rejected guesses' slots went back
    kv2.check_integrity()
