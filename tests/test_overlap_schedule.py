"""Overlapped scheduling (issue 19): token-identical to the sequential loop.

With overlap, step N+1's decode batch is formed while step N's forward runs on the
forward worker, and step N is resolved one step late (``radixserve.engine.scheduler.overlap``).
Every test runs the same work with overlap forced on (``enable_overlap_schedule``) and off
(``disable_overlap_schedule``) and wants the same tokens, texts and finish reasons, every
KV page and request slot back (the leak check is on), and overlapped steps actually taken
(``num_overlap_steps`` > 0), so the tests fail if the overlap path is missing.
"""

from __future__ import annotations

import pytest
from engine_checks import leak_checked_engine, wait_until_idle
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.request import Req
from radixserve.engine.scheduler.overlap import OverlapScheduler
from radixserve.sampling import SamplingBatchInfo, SamplingParams
from tiny_models import EOS, build_checkpoint, random_prompts

ON = {"enable_overlap_schedule": True}
OFF = {"disable_overlap_schedule": True}
MARK_TOP_K = 4243


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("overlap_llama"))
    build_checkpoint(path, "llama", seed=11, max_position_embeddings=512)
    return path


def _outputs(outs):
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def _both(path, prompts, params, **kw):
    """(outputs with overlap off, with overlap on, overlapped steps taken)."""
    res = {}
    for name, flags in (("off", OFF), ("on", ON)):
        with leak_checked_engine(path, **kw, **flags) as engine:
            assert (engine.scheduler.overlap is not None) == (name == "on")
            res[name] = _outputs(engine.generate(input_ids=prompts, sampling_params=params))
            res[name + "_steps"] = engine.scheduler.get_stats()["num_overlap_steps"]
    assert res["off_steps"] == 0
    return res["off"], res["on"], res["on_steps"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_tiny_model_mixed_finishes_are_identical(tiny_path, page_size):
    """Greedy and seeded sampling, n > 1, max_new_tokens, stop strings, stop token ids,
    EOS after min_new_tokens (EOS forced by logit_bias, banned until then), in one batch."""
    prompts = random_prompts(6, 17, seed=3)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with leak_checked_engine(tiny_path, **OFF) as engine:  # what the tiny model says, to pick stops from
        free = engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": 24})
    words = [o["text"].split() for o in free]
    params = [
        {**greedy, "max_new_tokens": 5},
        {**greedy, "max_new_tokens": 24, "stop": [words[1][6]]},  # a stop string mid-run
        {**greedy, "max_new_tokens": 24, "stop_token_ids": [free[2]["output_ids"][9]]},
        {"temperature": 0.0, "max_new_tokens": 24, "min_new_tokens": 7, "logit_bias": {str(EOS): 100.0}},
        {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_new_tokens": 20, "n": 3, "ignore_eos": True},
        {**greedy, "max_new_tokens": 31, "stop": [words[5][3]], "no_stop_trim": True},
    ]
    off, on, steps = _both(tiny_path, prompts, params, page_size=page_size)
    assert on == off
    assert steps > 0
    reasons = [r for _, _, r in off]
    assert reasons[1]["type"] == "stop" and reasons[2]["type"] == "stop"
    assert reasons[3] == {"type": "stop", "matched": EOS} and len(off[3][0]) == 8
    assert reasons[0] == {"type": "length", "length": 5}


def test_unsupported_requests_fall_back_and_stay_identical(tiny_path):
    """A penalty or logprobs in the batch makes those steps sequential; a batch of
    plain requests alone overlaps."""
    prompts = random_prompts(3, 12, seed=4)
    params = [{"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
              {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "repetition_penalty": 1.3},
              {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "return_logprob": True}]
    off, on, steps = _both(tiny_path, prompts, params)
    assert on == off and steps == 0
    off, on, steps = _both(tiny_path, prompts, params[:1] * 3)
    assert on == off and steps > 0


def test_requests_arriving_while_decoding(tiny_path):
    """A request added while others decode: the in-flight step is resolved, the prompt is
    prefilled (sequential step), then decoding overlaps again; a small pool retracts."""
    prompts = random_prompts(6, 30, seed=5)
    results = {}
    for name, flags in (("off", OFF), ("on", ON)):
        with leak_checked_engine(tiny_path, page_size=4, max_total_tokens=160, max_running_requests=4,
                                 **flags) as engine:
            sched = engine.scheduler
            reqs = [_req(f"r{i}", p, 18 + i) for i, p in enumerate(prompts)]
            with engine._inline_lock:
                for i, r in enumerate(reqs):
                    sched.add_request(r)
                    for _ in range(3 * i):
                        sched.step()
                while sched.has_work:
                    sched.step()
                sched.check_idle_invariant()
            results[name] = [(r.output_ids, r.finish_reason) for r in reqs]
            results[name + "_steps"] = sched.stats.num_overlap_steps
    assert results["on"] == results["off"]
    assert results["on_steps"] > 0


def _req(rid, prompt, n=12):
    p = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    p.verify()
    return Req(rid, list(prompt), p, n)


@pytest.mark.parametrize("target", ["one of three", "the last one"])
def test_abort_mid_run(tiny_path, target):
    prompts = random_prompts(3, 10, seed=6)
    with leak_checked_engine(tiny_path, **OFF) as engine:
        reference = [o["output_ids"] for o in engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})]
    with leak_checked_engine(tiny_path, **ON) as engine:
        sched = engine.scheduler
        reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts)]
        if target == "the last one":
            reqs = reqs[:1]
        with engine._inline_lock:
            for r in reqs:
                sched.add_request(r)
            victim = reqs[0]
            while len(victim.output_ids) < 4:
                sched.step()
            assert sched.overlap.inflight is not None  # a step is in flight when it is aborted
            produced = list(victim.output_ids)
            assert sched.abort(victim.rid)
            assert victim.finish_reason["type"] == "abort" and victim.output_ids == produced
            assert produced == reference[0][:len(produced)]
            while sched.has_work:
                sched.step()
            assert sched.overlap.inflight is None
            sched.check_idle_invariant()
        for i, r in enumerate(reqs[1:], 1):
            assert r.output_ids == reference[i]
        assert sched.stats.num_overlap_steps > 0


@pytest.mark.parametrize("fault", ["raises", "NaN", "sampler"])
def test_a_failing_decode_step_ends_only_its_request(tiny_path, monkeypatch, fault):
    """A forward (or the sampler's set-up) that fails for one request in an overlapped
    step: the step is redone sequentially, that request ends with 500 after the same
    tokens, the others go on."""
    prompts = random_prompts(3, 9, seed=7)
    params = [{"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}] * 3
    if fault == "sampler":  # a top_k no other request has marks request 1
        params = [params[0], {**params[0], "temperature": 0.7, "seed": 3, "top_k": MARK_TOP_K}, params[0]]
    marked = len(prompts[1]) + 5  # request 1 fails when its step computes position marked - 1
    build = SamplingBatchInfo.build.__func__

    def faulty_build(cls, params, generators, histories, num_output, *args, **kw):
        if any(p.top_k == MARK_TOP_K and n >= 5 for p, n in zip(params, num_output)):
            raise RuntimeError("injected sampler fault")
        return build(cls, params, generators, histories, num_output, *args, **kw)

    results = {}
    for name, flags in (("off", OFF), ("on", ON)):
        with leak_checked_engine(tiny_path, **flags) as engine:
            runner = engine.runner
            forward = runner.forward

            def faulty(batch, forward=forward):
                reqs = batch.extra.get("reqs", [])
                rows = [i for i, r in enumerate(reqs) if r.input_ids == prompts[1]
                        and batch.is_decode and batch.seq_lens_cpu[i] >= marked]
                if rows and fault == "raises":
                    raise RuntimeError("injected decode fault")
                logits = forward(batch)
                if rows and fault == "NaN":
                    logits = logits.clone()
                    logits[rows] = float("nan")
                return logits

            monkeypatch.setattr(runner, "forward", faulty)
            monkeypatch.setattr(SamplingBatchInfo, "build", classmethod(faulty_build))
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            monkeypatch.undo()
            results[name] = _outputs(outs)
            results[name + "_steps"] = engine.scheduler.stats.num_overlap_steps
    assert results["on"] == results["off"]
    assert results["on_steps"] > 0
    reason = results["on"][1][2]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert len(results["on"][1][0]) == 5
    assert [r["type"] for _, _, r in (results["on"][0], results["on"][2])] == ["length", "length"]


def test_flags():
    assert not ServerArgs().disable_overlap_schedule
    with pytest.raises(ConfigError, match="overlap"):
        ServerArgs(disable_overlap_schedule=True, enable_overlap_schedule=True)
    with pytest.raises(ConfigError, match="switch"):
        ServerArgs(disable_overlap_schedule="yes")


@pytest.mark.slow
def test_default_model_greedy_identical(default_engine):
    """The transformers-equality prompts of test_default_model (plain and chat), 64 greedy
    tokens in one batch: overlap on gives the sequential loop's tokens, EOS included. One
    engine (the session's), its overlap switched off and on between the runs."""
    from test_default_model import CHAT_CONVERSATIONS, GREEDY, PLAIN_PROMPTS

    sched = default_engine.scheduler
    chats = [default_engine.tokenizer.apply_chat_template(m) for m in CHAT_CONVERSATIONS]
    saved = sched.overlap
    outs = {}
    try:
        for name in ("off", "on"):
            sched.overlap = OverlapScheduler(sched) if name == "on" else None
            before = sched.stats.num_overlap_steps
            outs[name] = _outputs(default_engine.generate(PLAIN_PROMPTS + chats, GREEDY))
            outs[name + "_steps"] = sched.stats.num_overlap_steps - before
            wait_until_idle(default_engine)
    finally:
        sched.overlap = saved
    assert outs["off_steps"] == 0 and outs["on_steps"] > 0
    assert outs["on"] == outs["off"]
    assert any(r["type"] == "stop" for _, _, r in outs["on"])  # some stop at EOS


def test_forward_worker_runs_every_forward(tiny_path):
    """With overlap on, prefill and sequential steps also run on the forward worker (one
    thread for every forward: torch's CPU thread pool stays with it)."""
    threads = set()
    with leak_checked_engine(tiny_path, **ON) as engine:
        forward = engine.runner.model.forward

        def spy(batch):
            import threading

            threads.add(threading.current_thread().name)
            return forward(batch)

        engine.runner.model.forward = spy
        try:
            engine.generate(input_ids=random_prompts(2, 8, seed=8),
                            sampling_params={"temperature": 0.0, "max_new_tokens": 6, "repetition_penalty": 1.1})
        finally:
            del engine.runner.model.forward
    assert len(threads) == 1 and next(iter(threads)).startswith("radixserve-forward")


def test_the_stepping_thread_keeps_its_ops_serial_while_it_steps(tiny_path):
    """While a thread steps the overlap scheduler its own torch ops are serial (no second OpenMP
    pool beside the forward worker's); afterwards its thread count is back, and the worker
    runs with torch's full count throughout."""
    import torch
    from radixserve.kernels import cpu as cpu_kernels

    before = torch.get_num_threads()
    stepping, worker = [], []
    with leak_checked_engine(tiny_path, **ON) as engine:
        forward, overlap_step = engine.runner.model.forward, engine.scheduler.overlap.step

        def spy_forward(batch):
            worker.append(torch.get_num_threads())
            return forward(batch)

        def spy_step():
            stepping.append(torch.get_num_threads())
            return overlap_step()

        engine.runner.model.forward = spy_forward
        engine.scheduler.overlap.step = spy_step
        try:
            engine.generate(input_ids=random_prompts(2, 8, seed=9),
                            sampling_params={"temperature": 0.0, "max_new_tokens": 6})
        finally:
            del engine.runner.model.forward
        assert engine.scheduler.get_stats()["num_overlap_steps"] > 0
    if cpu_kernels.load() is not None:  # (without the kernels there is nothing to set: a no-op)
        assert set(stepping) == {1}
    assert set(worker) == {engine.scheduler.overlap.num_threads} and torch.get_num_threads() == before


def test_serial_section_sets_only_the_calling_threads_count():
    """cpu_kernels.serial_section: inside, the calling thread's torch thread count is 1 and
    another thread's is untouched; on leaving, the count is restored."""
    import threading

    import torch
    from radixserve.kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    before = torch.get_num_threads()
    inside, other = [], []
    with cpu_kernels.serial_section():
        inside.append(torch.get_num_threads())
        t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        t.start()
        t.join()
    assert inside == [1] and other == [before]
    assert torch.get_num_threads() == before
