"""Priority scheduling, step by step on a tiny random-weight Llama.

Lower ``priority`` values are served first; a more urgent request preempts (retracts) the
least urgent running ones when it finds no running slot or too few KV pages, only when it
is more urgent by more than the threshold, and the preempted requests resume with exactly
the greedy output they would have produced. Every engine ends with the idle invariant.
"""

from __future__ import annotations

import pytest
from engine_checks import leak_checked_engine
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.priority import preemption_victims, resolve_priority
from radixserve.engine.scheduler import RequestRejected
from tiny_models import build_checkpoint, random_prompts

LONG = 40  # new tokens of the low-priority requests
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prio_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


engine_for = leak_checked_engine


def add(engine, rid: str, ids: list[int], max_new: int, priority=None):
    """Queue one greedy request directly in the scheduler (no thread): returns its Req."""
    seqs, params, _ = engine.normalize(None, ids, dict(GREEDY, max_new_tokens=max_new))
    (req,), = engine.make_requests(seqs, params, rids=[rid], priorities=[priority])
    engine.scheduler.add_request(req)
    return req


def drain(sched, reqs):
    while not all(r.finished for r in reqs):
        sched.step()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 16, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_path, prompts):
    """Each prompt's greedy output alone (no priority, no preemption)."""
    with engine_for(tiny_path) as engine:
        return [engine.generate(input_ids=p, sampling_params=dict(GREEDY, max_new_tokens=LONG))["output_ids"]
                for p in prompts]


def test_urgent_request_preempts_a_full_batch_and_everyone_resumes_intact(tiny_path, prompts, reference):
    with engine_for(tiny_path, enable_priority_scheduling=True, max_running_requests=2) as engine:
        sched = engine.scheduler
        low = [add(engine, f"low{i}", prompts[i], LONG, priority=5) for i in range(2)]
        sched.step()  # both prefilled together
        for _ in range(3):
            sched.step()
        assert sched.running == low and all(len(r.output_ids) == 4 for r in low)
        high = add(engine, "high", prompts[2], 3, priority=0)
        sched.step()  # the batch is full: the least urgent (equal: least progress) is preempted
        assert high in sched.running and sched.stats.num_preemptions == 1
        preempted = [r for r in low if r not in sched.running]
        assert len(preempted) == 1 and list(sched.waiting) == preempted
        assert sched.get_stats()["num_preemptions"] == 1
        assert sched.stats.num_retractions == 0  # not for want of memory
        drain(sched, [high])
        assert not any(r.finished for r in low)  # the urgent request finished first
        drain(sched, low)
        # the preempted request resumed where it was; it never preempted back
        assert [r.output_ids for r in low] == reference[:2]
        assert sched.stats.num_preemptions == 1
        assert high.output_ids == reference[2][:3]
        assert preempted[0].num_retractions == 1


def test_equal_or_near_priority_never_preempts(tiny_path, prompts):
    with engine_for(tiny_path, enable_priority_scheduling=True, max_running_requests=2,
                    priority_scheduling_preemption_threshold=3) as engine:
        sched = engine.scheduler
        low = [add(engine, f"low{i}", prompts[i], LONG, priority=5) for i in range(2)]
        sched.step()
        for priority in (5, 2):  # equal, then more urgent by exactly the threshold
            req = add(engine, f"p{priority}", prompts[2], 2, priority=priority)
            sched.step()
            assert sched.running == low and sched.stats.num_preemptions == 0
            sched.abort(req.rid)
        urgent = add(engine, "urgent", prompts[2], 2, priority=1)  # by more than the threshold
        sched.step()
        assert urgent in sched.running and sched.stats.num_preemptions == 1
        drain(sched, low + [urgent])


def test_disabled_preemption_only_orders_the_queue(tiny_path, prompts):
    with engine_for(tiny_path, enable_priority_scheduling=True, max_running_requests=1,
                    disable_priority_preemption=True) as engine:
        sched = engine.scheduler
        low = add(engine, "low", prompts[0], LONG, priority=5)
        sched.step()
        add(engine, "mid", prompts[1], 2, priority=3)
        add(engine, "high", prompts[2], 2, priority=-1)
        for _ in range(3):
            sched.step()
        assert sched.running == [low] and sched.stats.num_preemptions == 0
        drain(sched, [low])
        order = []
        while sched.has_work:
            order += [r.rid for r in sched.step() if r.finished]
        assert order == ["high", "mid"]


def test_waiting_queue_orders_by_priority_then_policy(tiny_path, prompts):
    with engine_for(tiny_path, enable_priority_scheduling=True, schedule_policy="fcfs") as engine:
        sched = engine.scheduler
        reqs = [add(engine, f"r{i}", prompts[0], 1, priority=p) for i, p in enumerate((3, 1, None, 1, -2))]
        assert [r.priority for r in reqs] == [3, 1, 0, 1, -2]  # none given: --default-priority-value
        assert [r.rid for r in sched.planner.order()] == ["r4", "r2", "r1", "r3", "r0"]
        drain(sched, reqs)


def test_memory_short_urgent_request_preempts_for_pages(tiny_path, prompts):
    # 128 KV slots: two 16-token prompts decoding 40 tokens each hold most of them, and the
    # running requests' reserved future tokens leave no room for an 80-token prompt
    long_prompt = random_prompts(1, 80, seed=9)[0]
    with engine_for(tiny_path, enable_priority_scheduling=True, max_total_tokens=128,
                    disable_radix_cache=True) as engine:
        sched = engine.scheduler
        low = [add(engine, f"low{i}", prompts[i], LONG, priority=1) for i in range(2)]
        sched.step()
        high = add(engine, "high", long_prompt, 4, priority=0)
        sched.step()
        assert high in sched.running and sched.stats.num_preemptions >= 1
        drain(sched, [high])
        drain(sched, low)


def test_without_the_flag_priority_is_ignored_or_refused(tiny_path, prompts):
    with engine_for(tiny_path, max_running_requests=1) as engine:
        sched = engine.scheduler
        reqs = [add(engine, f"r{i}", prompts[i], 2, priority=p) for i, p in enumerate((9, -9))]
        assert [r.priority for r in reqs] == [0, 0]
        assert [r.rid for r in sched.planner.order()] == ["r0", "r1"]
        drain(sched, reqs)
        out = engine.generate(input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=2), priority=7)
        assert len(out["output_ids"]) == 2
    with engine_for(tiny_path, abort_on_priority_when_disabled=True) as engine:
        with pytest.raises(RequestRejected, match="--enable-priority-scheduling") as info:
            engine.generate(input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=2), priority=1)
        assert info.value.param == "priority"
        engine.generate(input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=2))  # none given: fine


def test_priority_resolution_and_flags():
    on = ServerArgs(enable_priority_scheduling=True, default_priority_value=4)
    assert resolve_priority(on, None) == 4 and resolve_priority(on, -3) == -3
    for bad in ("1", 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            resolve_priority(on, bad)
    assert resolve_priority(ServerArgs(), 8) == 0
    with pytest.raises(ConfigError, match="--priority-scheduling-preemption-threshold"):
        ServerArgs(priority_scheduling_preemption_threshold=-1)
    with pytest.raises(ConfigError, match="--enable-priority-scheduling"):
        ServerArgs(enable_priority_scheduling="yes")
    assert ServerArgs(schedule_low_priority_values_first=True).schedule_low_priority_values_first


def test_victims_are_least_urgent_first_and_only_beyond_the_threshold():
    from radixserve.engine.request import Req
    from radixserve.sampling import SamplingParams

    def req(rid, priority, out):
        r = Req(rid, [1, 2, 3], SamplingParams(), 10, priority=priority)
        r.output_ids = [0] * out
        return r

    running = [req("a", 5, 3), req("b", 9, 8), req("c", 9, 2), req("d", 2, 0)]
    urgent = req("u", 1, 0)
    assert [r.rid for r in preemption_victims(urgent, running, 0)] == ["c", "b", "a", "d"]
    assert [r.rid for r in preemption_victims(urgent, running, 4)] == ["c", "b"]
    assert preemption_victims(req("v", 9, 0), running, 0) == []  # equal never preempts
