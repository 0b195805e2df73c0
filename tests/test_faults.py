"""Fault isolation in the core: one request's failure ends that request only.

A test plugin (``tests/plugins/faults``, registered in-process here) fails on marked
requests: in the attention backend's per-step metadata, with NaN attention output, in the
sampler, and in a grammar matcher's ``fill_bitmask`` / ``accept_token``. Each marked
request must end with finish reason ``abort`` / status 500, its neighbours in the same
batch must produce exactly the tokens they produce alone, every page and request slot
must come back, and the engine must serve the next request. A forward failure with no
single culprit fails its batch; ``--max-consecutive-failed-steps`` of them stop the
engine, and then every waiting call raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
import radixserve
from engine_checks import wait_until_idle
from radixserve.engine.engine import EngineError
from radixserve.engine.request import Req
from radixserve.registry import Registry
from radixserve.sampling import SamplingParams
from tiny_models import build_checkpoint

sys.path.insert(0, str(Path(__file__).parent / "plugins" / "faults"))
import radixserve_faults as faults  # noqa: E402

sys.path.pop(0)

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
P1 = [5, 17, 42, 99, 23, 61]
P2 = [201, 13, 77, 4, 150]
P3 = [33, 34, 35, 36, 37, 38, 39, 40]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("faults_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(faults, name="faults", distribution="radixserve-faults")
    yield reg
    reg.remove_plugin("faults")


def make_engine(path, registry, **kw):
    kw.setdefault("max_total_tokens", 2048)
    kw.setdefault("enable_leak_check", True)
    return radixserve.Engine(path, registry=registry, attention_backend="faulty", grammar_backend="faulty", **kw)


@pytest.fixture(scope="module")
def engine(tiny_path, registry):
    eng = make_engine(tiny_path, registry)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def alone(engine):
    """Each clean prompt's greedy tokens, generated on its own."""
    return {tuple(p): engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in (P1, P2, P3)}


def _server_error(out) -> dict:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    return reason


def _check_neighbours(outs, alone, marked_index):
    clean = [p for p in (P1, P2, P3)]
    k = 0
    for i, out in enumerate(outs):
        if i == marked_index:
            continue
        assert out["output_ids"] == alone[tuple(clean[k])], f"neighbour {k} changed"
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        k += 1


@pytest.mark.parametrize("where,marked,params,message", [
    ("attention metadata", P2[:2] + [faults.METADATA_FAULT_TOKEN], {}, "injected fault in init_forward_metadata"),
    ("NaN logits", [faults.NAN_TOKEN] + P2, {}, "NaN logits"),
    ("sampler", P2, {"top_k": faults.SAMPLER_FAULT_TOP_K, "temperature": 0.8, "seed": 1},
     "injected fault in the sampler"),
    ("grammar fill_bitmask", P2, {"regex": "fill:11,12,13"}, "injected fault in fill_bitmask"),
    ("grammar accept_token", P2, {"regex": "accept:11,12"}, "injected fault in accept_token"),
])
def test_a_failing_request_ends_alone(engine, alone, where, marked, params, message):
    before = engine.get_stats()
    prompts = [P1, marked, P2, P3]
    plist = [GREEDY, {**GREEDY, **params}, GREEDY, GREEDY]
    outs = engine.generate(input_ids=prompts, sampling_params=plist)
    reason = _server_error(outs[1])
    assert message in reason["message"], (where, reason)
    _check_neighbours(outs, alone, 1)
    wait_until_idle(engine)
    after = engine.get_stats()
    assert after["num_aborted_reqs"] == before["num_aborted_reqs"] + 1
    # and the engine goes on serving
    assert engine.generate(input_ids=P1, sampling_params=GREEDY)["output_ids"] == alone[tuple(P1)]


def test_grammar_faults_fail_after_the_tokens_they_allowed(engine):
    out = engine.generate(input_ids=P1, sampling_params={**GREEDY, "regex": "accept:11,12"})
    assert out["output_ids"] == [11, 12, out["output_ids"][2]]  # the third token was sampled, then raised
    _server_error(out)
    ok = engine.generate(input_ids=P1, sampling_params={**GREEDY, "regex": "ok:11,12"})
    assert ok["output_ids"][:2] == [11, 12] and ok["meta_info"]["finish_reason"]["type"] == "stop"


def test_failing_requests_in_a_decode_batch(engine, alone):
    """Failures while decoding (not at the first token) also end only their request."""
    plist = [GREEDY, {**GREEDY, "regex": "fill:11,12,13,14"}, GREEDY, {**GREEDY, "regex": "accept:11,12,13"}]
    outs = engine.generate(input_ids=[P1, P2, P3, P2], sampling_params=plist)
    assert outs[0]["output_ids"] == alone[tuple(P1)] and outs[2]["output_ids"] == alone[tuple(P3)]
    assert outs[1]["output_ids"][:4] == [11, 12, 13, 14]
    _server_error(outs[1])
    _server_error(outs[3])


def test_a_batch_failure_with_no_culprit_fails_the_batch_and_the_engine_goes_on(engine, alone):
    batch = [P1, [faults.BATCH_FAULT_TOKEN] + P3]
    outs = engine.generate(input_ids=batch, sampling_params=GREEDY)
    for out in outs:
        reason = _server_error(out)
        assert "injected batch fault" in reason["message"]
    assert engine.scheduler.forward.consecutive_failed_steps == 1
    assert engine.generate(input_ids=P1, sampling_params=GREEDY)["output_ids"] == alone[tuple(P1)]
    assert engine.scheduler.forward.consecutive_failed_steps == 0


def test_an_output_callback_that_raises_ends_its_request_only(engine, alone):
    sched = engine.scheduler
    p = SamplingParams(**GREEDY)
    p.verify()

    def boom(req, n, finished):
        raise RuntimeError("a caller's bug")

    bad = Req("bad-callback", list(P2), p, 10, on_output=boom)
    good = Req("good", list(P1), p, 10)
    with engine._inline_lock:
        sched.add_request(bad)
        sched.add_request(good)
        while sched.has_work:
            sched.step()
    assert bad.finish_reason["status_code"] == 500 and "callback" in bad.finish_reason["message"]
    assert good.output_ids == alone[tuple(P1)]


def test_queue_limit_refuses_with_429(tiny_path, registry):
    with make_engine(tiny_path, registry, max_queued_requests=2) as eng:
        p = SamplingParams(**GREEDY)
        p.verify()
        reqs = [Req(f"q{i}", list(P1), p, 10) for i in range(4)]
        with eng._inline_lock:
            for r in reqs:
                eng.scheduler.add_request(r)
            assert [r.finished for r in reqs] == [False, False, True, True]
            for r in reqs[2:]:
                assert r.finish_reason["status_code"] == 429 and "--max-queued-requests 2" in r.finish_reason["message"]
            while eng.scheduler.has_work:
                eng.scheduler.step()
        assert all(len(r.output_ids) == 10 for r in reqs[:2])
        wait_until_idle(eng)


def test_max_new_tokens_zero_generates_nothing(engine):
    out = engine.generate(input_ids=P1, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] == len(P1)


def test_consecutive_failed_steps_stop_the_engine(tiny_path, registry):
    eng = make_engine(tiny_path, registry, max_consecutive_failed_steps=2, max_running_requests=2,
                      enable_leak_check=False)
    try:
        batches = [[P1, [faults.BATCH_FAULT_TOKEN] + P2], [P3, [faults.BATCH_FAULT_TOKEN] + P1]]
        with pytest.raises(EngineError, match="2 forward steps in a row failed"):
            eng.generate(input_ids=[p for b in batches for p in b], sampling_params=GREEDY)
        with pytest.raises(EngineError, match="forward steps in a row"):  # dead: every call raises
            eng.generate(input_ids=P1, sampling_params=GREEDY)
    finally:
        eng.shutdown()


# ----------------------------------------------------------- engine death
def _threaded(eng):
    """Start the engine's background scheduler thread (as async_generate does)."""
    eng._ensure_loop()
    return eng


def test_dead_loop_fails_every_waiting_call(tiny_path, registry, monkeypatch):
    eng = _threaded(make_engine(tiny_path, registry, enable_leak_check=False))
    try:
        long = {**GREEDY, "max_new_tokens": 200}
        errors: list[BaseException] = []

        def call():
            try:
                eng.generate(input_ids=P1, sampling_params=long)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        async def stream():
            chunks = []
            with pytest.raises(EngineError, match="loop died"):
                async for chunk in await eng.async_generate(input_ids=P2, sampling_params=long, stream=True):
                    chunks.append(chunk)
            return chunks

        t = threading.Thread(target=call)
        t.start()
        started = time.monotonic()

        def die():
            while eng.scheduler.stats.num_decode_tokens < 3:
                time.sleep(0.01)
            monkeypatch.setattr(eng.scheduler, "step", lambda: (_ for _ in ()).throw(RuntimeError("scheduler bug")))

        killer = threading.Thread(target=die)
        killer.start()
        asyncio.run(stream())
        t.join(10)
        killer.join(10)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], EngineError)
        assert "scheduler bug" in str(errors[0])
        assert time.monotonic() - started < 10
        with pytest.raises(EngineError):
            eng.flush_cache(timeout=5)
        with pytest.raises(EngineError):
            eng.generate(input_ids=P1, sampling_params=GREEDY)
    finally:
        eng.shutdown()


def test_shutdown_fails_in_flight_and_compiling_requests(tiny_path, registry):
    eng = _threaded(make_engine(tiny_path, registry))
    faults.GATE.clear()
    results: dict[str, BaseException | dict] = {}

    def call(name, params):
        try:
            results[name] = eng.generate(input_ids=P1, sampling_params=params)
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    threads = [threading.Thread(target=call, args=("running", {**GREEDY, "max_new_tokens": 400})),
               threading.Thread(target=call, args=("compiling", {**GREEDY, "regex": "gate:11"}))]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not (eng.scheduler.grammar_queue and eng.scheduler.stats.num_decode_tokens > 2):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        eng.shutdown()
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        for name in ("running", "compiling"):
            assert isinstance(results[name], EngineError), results[name]
            assert "shut down" in str(results[name])
        eng.check_idle_invariant()  # every page and slot back
        with pytest.raises(EngineError, match="shut down"):
            eng.generate(input_ids=P1, sampling_params=GREEDY)
    finally:
        faults.GATE.set()
        eng.shutdown()
