"""Stall-free batching (the default): mixed steps, and a per-step prefill budget from
measured step costs unless ``--chunked-prefill-size`` fixes the chunk.

The budget rule is checked with injected step times (no wall clock); the engine tests
drive a fresh tiny engine's scheduler by hand, so a prompt arrives while others decode.
"""

from __future__ import annotations

import pytest
import radixserve
import torch
from radixserve.engine.request import Req
from radixserve.engine.scheduler.budget import AUTO_CHUNK, COLD_START_TOKENS, MIN_PREFILL_TOKENS, StepBudget
from radixserve.flags import ConfigError
from radixserve.sampling import SamplingParams
from tiny_models import VOCAB, build_checkpoint

NEW_TOKENS = 10


# ------------------------------------------------------------------ the rule
def test_budget_before_measurement_and_without_decoding_requests():
    b = StepBudget(AUTO_CHUNK)
    assert b.prefill_tokens(0) == AUTO_CHUNK  # nobody waits: the full chunk
    assert b.prefill_tokens(4) == COLD_START_TOKENS  # costs not measured yet
    b.observe_decode(4, 0.010)
    assert b.prefill_tokens(4) == COLD_START_TOKENS  # prefill cost still unknown


def test_budget_follows_measured_costs():
    b = StepBudget(AUTO_CHUNK)
    b.observe_decode(8, 0.100)  # a plain decode step of 8: 100 ms
    b.observe_step(1000, 8, 0.600)  # 1000 prefill tokens beside 8 decodes: 0.5 ms a token
    assert b.seconds_per_token == pytest.approx(0.0005, rel=1e-3)
    assert b.decode_seconds(8) == pytest.approx(0.100, rel=1e-3)
    # target 2 x 100 ms: 100 ms of prefill = 200 tokens
    assert b.prefill_tokens(8) == pytest.approx(200, abs=1)
    for _ in range(200):  # prefill got twice as costly: half the tokens
        b.observe_step(200, 8, 0.300)
        b.observe_decode(8, 0.100)
    assert b.prefill_tokens(8) == pytest.approx(100, abs=2)
    for _ in range(200):  # decode steps got slower: the target grows with them
        b.observe_step(200, 8, 0.400)
        b.observe_decode(8, 0.200)
    assert b.prefill_tokens(8) == pytest.approx(200, abs=2)


def test_decode_cost_at_the_running_batch_size_comes_from_mixed_steps():
    """Under a steady stream of prompts nearly every step is mixed: plain decode steps were
    only seen at small batches, yet the fit finds the cost of a decode row from mixed steps
    of several sizes (step = 10 ms + 5 ms a row + 1 ms a token)."""
    b = StepBudget(AUTO_CHUNK)
    for rows in (1, 2):
        b.observe_decode(rows, 0.010 + 0.005 * rows)
    for i in range(40):
        rows, n = 12 + i % 5, 64 + 16 * (i % 3)
        b.observe_step(n, rows, 0.010 + 0.005 * rows + 0.001 * n)
    assert b.decode_seconds(16) == pytest.approx(0.090, rel=1e-3)
    assert b.seconds_per_token == pytest.approx(0.001, rel=1e-3)
    assert b.prefill_tokens(16) == 90  # (2 x 90 ms - 90 ms) / 1 ms


def test_budget_floor_cap_target_flag():
    b = StepBudget(512)
    b.observe_decode(2, 0.010)
    b.observe_decode(10, 0.030)
    b.observe_step(100, 2, 0.010 + 0.100)  # 1 ms a token
    assert b.decode_seconds(6) == pytest.approx(0.020, rel=1e-3)  # linear in the batch size
    assert b.decode_seconds(40) == pytest.approx(0.105, rel=1e-3)
    assert b.prefill_tokens(6) == MIN_PREFILL_TOKENS  # 20 ms of room = 20 tokens: the floor
    fixed = StepBudget(512, target_seconds=1.0)  # --mixed-chunk-target-itl-ms 1000
    fixed.observe_decode(2, 0.010)
    fixed.observe_step(100, 2, 0.110)
    assert fixed.prefill_tokens(2) == 512  # 990 tokens of room, capped at the chunk
    assert fixed.target_seconds(2) == 1.0


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stall_free_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 300, 41, 150)]


def staggered(path, **kw) -> tuple[list[list[int]], list[tuple[int, int]], object]:
    """Greedy outputs of :func:`prompts` on a fresh engine, the first prompt alone, the others
    added once it decodes; with each step's (prefill tokens, decoding riders)."""
    engine = radixserve.Engine(path, dtype="float32", max_total_tokens=4096, enable_leak_check=True, **kw)
    try:
        sched = engine.scheduler
        steps: list[tuple[int, int]] = []
        run = sched.prefill.run

        def spy(plan, riders, failed, t0):
            steps.append((sum(n for _, n in plan), len(riders)))
            return run(plan, riders, failed, t0)

        sched.prefill.run = spy
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        reqs = [Req(f"r{i}", p, params, NEW_TOKENS) for i, p in enumerate(prompts())]
        sched.add_request(reqs[0])
        while len(reqs[0].output_ids) < 2:
            sched.step()
        for r in reqs[1:]:
            sched.add_request(r)
        n = 0
        while sched.has_work:
            sched.step()
            n += 1
            assert n < 500
        sched.check_idle_invariant()
        return [r.output_ids for r in reqs], steps, sched
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def old_path(tiny_path):
    """The old default: no mixed steps, 2048-token chunks."""
    return staggered(tiny_path, disable_mixed_chunk=True, chunked_prefill_size=2048)


def test_disable_mixed_chunk_runs_separate_prefill_steps(old_path):
    outs, steps, sched = old_path
    assert sched.stats.num_mixed_steps == 0 and all(riders == 0 for _, riders in steps)
    assert (491, 0) in steps  # the three late prompts in one prefill step, the decoding request waiting
    assert all(len(o) == NEW_TOKENS for o in outs)


def test_default_runs_budgeted_mixed_steps_with_unchanged_tokens(tiny_path, old_path):
    # a tiny target: every mixed step takes the budget's floor, so the long prompts are chunked
    outs, steps, sched = staggered(tiny_path, mixed_chunk_target_itl_ms=1e-3)
    assert outs == old_path[0]
    assert sched.planner.step_budget is sched.budget
    mixed = [n for n, riders in steps if riders]
    assert sched.stats.num_mixed_steps == len(mixed) >= 5
    assert max(mixed) <= MIN_PREFILL_TOKENS  # no decoding request waits on more than one budget
    assert sched.get_stats()["step_budget_tokens"] == MIN_PREFILL_TOKENS
    assert sched.budget.seconds_per_token is not None and sched.budget.decode_seconds(1) is not None


def test_default_flags_budget_from_measurement(tiny_path, old_path):
    outs, steps, sched = staggered(tiny_path)
    assert outs == old_path[0]
    assert sched.stats.num_mixed_steps > 0
    assert sched.args.chunked_prefill_size is None and sched.planner.step_budget is sched.budget


def test_explicit_chunked_prefill_size_is_a_fixed_chunk(tiny_path, old_path):
    outs, steps, sched = staggered(tiny_path, chunked_prefill_size=32, mixed_chunk_target_itl_ms=1e-3)
    assert outs == old_path[0]
    assert sched.planner.step_budget is None
    assert max(n for n, _ in steps) == 32 and sched.stats.num_mixed_steps > 0
    # the 300-token prompt alone: 9 chunks of 32 and one of 12
    assert sum(1 for n, _ in steps if n == 32) >= 9


def test_enable_and_disable_mixed_chunk_contradict(tiny_path):
    with pytest.raises(ConfigError, match="--disable-mixed-chunk"):
        radixserve.Engine(tiny_path, dtype="float32", enable_mixed_chunk=True, disable_mixed_chunk=True)
    with pytest.raises(ConfigError, match="--mixed-chunk-target-itl-ms"):
        radixserve.Engine(tiny_path, dtype="float32", mixed_chunk_target_itl_ms=0)
