"""Grammar compiles a client cannot turn against others: killed at the time limit, capped
per client, and refused when the constraint is too large.

The deep-tree test runs the real xgrammar backend (compiles in worker processes): ten JSON
schemas of a deep object tree, each of which takes about half a minute to compile here,
time out; their worker processes are killed, a plain stream keeps its speed, and the next
small grammar compiles at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import threading
import time

import pytest
import torch
from radixserve.config import ConfigError, ServerArgs
from radixserve.grammar import GrammarBackend, GrammarError
from radixserve.grammar.manager import GrammarManager
from radixserve.sampling import InvalidSamplingParams
from radixserve.testing.deep_schema import deep_tree_schema
from radixserve.testing.forced_grammar import ForcedMatcher

TIMEOUT = 2.0  # --grammar-compile-timeout of the deep-tree test
NUM_DEEP = 10
PLAIN = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def _ms_per_token(engine) -> float:
    start = time.perf_counter()
    out = engine.generate("Count to twenty:", PLAIN)
    assert len(out["output_ids"]) == PLAIN["max_new_tokens"]
    return (time.perf_counter() - start) * 1000 / PLAIN["max_new_tokens"]


@pytest.fixture(scope="module")
def xgrammar_engine():
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("needs the xgrammar backend (pip install radixserve-grammar-xgrammar)")
    import radixserve

    threads = torch.get_num_threads()
    eng = radixserve.Engine(grammar_backend="xgrammar", grammar_compile_timeout=TIMEOUT,
                            max_total_tokens=2048, num_threads=1)
    try:
        yield eng
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)


def test_deep_tree_compiles_are_killed_and_others_keep_their_speed(xgrammar_engine):
    engine = xgrammar_engine
    grammar = engine.scheduler.grammar
    assert grammar.processes is not None, "xgrammar compiles in worker processes"
    # async_generate starts the engine's loop thread: from here on generate() calls on two
    # threads are served side by side (an inline generate would hold the scheduler)
    warm = asyncio.run(engine.async_generate("Yes or no?", {"regex": "(yes|no)", "max_new_tokens": 4}))
    assert warm["text"] in ("yes", "no")
    assert grammar.processes.wait_idle()  # booted: what a kill hands over at once
    base = min(_ms_per_token(engine) for _ in range(2))

    deep = [{"json_schema": deep_tree_schema(i), "max_new_tokens": 8} for i in range(NUM_DEEP)]
    results: list = []
    batch = threading.Thread(target=lambda: results.extend(engine.generate(["Describe it."] * NUM_DEEP, deep)))
    start = time.monotonic()
    batch.start()
    during = _ms_per_token(engine)  # while two deep compiles run
    batch.join(timeout=60)
    assert not batch.is_alive() and len(results) == NUM_DEEP
    for out in results:
        reason = out["meta_info"]["finish_reason"]
        assert reason["status_code"] == 400 and "timed out after 2 s" in reason["message"], reason
    assert time.monotonic() - start < TIMEOUT + 5

    # the processes that ran the deep compiles were killed (SIGKILL) and are gone; the
    # compiles that never started are not cached (a worker started in place of a killed one
    # may pick up one more queued compile before its deadline passes: it is killed too)
    jobs = [grammar._cache.get(("json_schema", d["json_schema"])) for d in deep]
    killed = [j.process for j in jobs if j is not None]
    assert grammar.num_workers <= len(killed) == grammar.stats()["num_grammar_compiles_killed"] < NUM_DEEP
    for proc in killed:
        assert proc.popen.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(f"/proc/{proc.pid}")

    # once the killed processes' replacements have booted (awaited, not slept: on a loaded
    # 2-core machine a boot takes seconds), the next small grammar compiles at once, and is cached
    assert grammar.processes.wait_idle()
    t = time.monotonic()
    small = engine.generate("Pick a digit.", {"regex": "[0-9]", "max_new_tokens": 4})
    took = time.monotonic() - t
    assert small["meta_info"]["finish_reason"]["type"] == "stop" and small["text"].isdigit()
    # (it can queue behind one doomed compile a replacement worker started just before its deadline,
    # then that worker's next boot: up to ~1.75x the timeout on a 2-core machine, never another timeout)
    assert took < 2 * TIMEOUT, f"a one-character regex took {took:.2f} s after the deep compiles"
    hits = grammar.num_cache_hits
    again = engine.generate("Pick a digit.", {"regex": "[0-9]", "max_new_tokens": 4})
    assert again["text"].isdigit() and grammar.num_cache_hits == hits + 1

    after = _ms_per_token(engine)
    assert during < 3 * base + 20, f"{during:.0f} ms/token beside the deep compiles, {base:.0f} before"
    assert after < 2 * base + 10, f"{after:.0f} ms/token after the deep compiles, {base:.0f} before"


# ------------------------------------------------- limits (a throwaway backend)
class GatedBackend(GrammarBackend):
    """Thread mode: ``regex`` text ``"<gate>|5,6"`` compiles once GATES[gate] is set."""

    name = "gated"

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}

    def compile(self, kind, text):
        gate, _, ids = text.partition("|")
        if not self.gates.setdefault(gate, threading.Event()).wait(30):
            raise GrammarError("gate never opened")
        return [int(x) for x in ids.split(",")]

    def new_matcher(self, compiled):
        return ForcedMatcher(compiled, [2], False)


def test_compiles_per_client_are_capped(monkeypatch):
    """A client's compiles beyond --grammar-max-compiles-per-client wait for its own to end
    (never taking another worker); past MAX_HELD_PER_CLIENT waiting they are refused."""
    from radixserve.grammar import manager as manager_mod

    monkeypatch.setattr(manager_mod, "MAX_HELD_PER_CLIENT", 2)
    backend = GatedBackend()
    manager = GrammarManager(backend, compile_timeout=30, num_workers=4, max_compiles_per_client=1)
    gate = backend.gates.setdefault("a", threading.Event())
    alice, bob = "10.0.0.1", "10.0.0.2"
    try:
        first = manager.get(("regex", "a|5"), client=alice)
        held = [manager.get(("regex", f"b|{i}"), client=alice) for i in (6, 7)]  # gate b is open below
        refused = manager.get(("regex", "b|8"), client=alice)
        assert refused.is_done and refused.status_code == 429
        assert "--grammar-max-compiles-per-client 1" in refused.error
        assert manager.get(("regex", "a|5"), client=alice) is first  # joining costs nothing
        backend.gates.setdefault("b", threading.Event()).set()
        other = manager.get(("regex", "b|9"), client=bob)  # another client is not held
        engine_own = manager.get(("regex", "b|10"))  # no client: not limited
        assert other.done.wait(10) and engine_own.done.wait(10) and other.error is None
        assert not any(j.is_done for j in held), "held compiles ran beside the client's first"
        assert manager.get(("regex", "b|8"), client=alice) is not refused  # a refusal is not cached
    finally:
        gate.set()
    for job in [first, *held]:
        assert job.done.wait(10) and job.error is None
    assert not manager._active and not manager._held


def test_held_compiles_time_out_where_they_wait():
    backend = GatedBackend()
    manager = GrammarManager(backend, compile_timeout=30, num_workers=2, max_compiles_per_client=1)
    gate = backend.gates.setdefault("c", threading.Event())
    try:
        running = manager.get(("regex", "c|5"), client="x")
        waiting = manager.get(("regex", "c|6"), client="x")
        manager.check_timeout(waiting, now=waiting.submitted + 31)
        assert waiting.is_done and "timed out" in waiting.error
        assert not manager._held and manager.get(("regex", "c|6"), client="x") is not waiting  # not cached
    finally:
        gate.set()
    assert running.done.wait(10) and running.error is None


def test_oversized_constraints_are_refused_naming_the_field():
    from radixserve.grammar import check_constraint_size
    from radixserve.sampling import SamplingParams

    schema = json.dumps({"type": "object", "properties": {"a" * 200: {"type": "string"}}})
    for field, text in (("json_schema", schema), ("regex", "x" * 300), ("ebnf", 'root ::= "' + "é" * 150 + '"')):
        params = SamplingParams(**{field: text})
        check_constraint_size(params, 0)  # 0: no limit
        check_constraint_size(params, 1000)
        with pytest.raises(InvalidSamplingParams, match=f"{field} is .* bytes, over the limit of 200 "
                                                        r"\(--grammar-max-spec-bytes\)") as e:
            check_constraint_size(params, 200)
        assert e.value.param == field


def test_grammar_limit_flags():
    args = ServerArgs.from_kwargs()
    assert args.grammar_max_spec_bytes == 1 << 20 and args.grammar_max_compiles_per_client == 1
    for flag in ("grammar_max_spec_bytes", "grammar_max_compiles_per_client"):
        with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}"):
            ServerArgs.from_kwargs(**{flag: -1})


def test_a_compile_process_outlives_the_thread_that_started_it():
    """Linux sends a child's parent-death signal when the *thread* that started it exits: a
    compile thread that leaves (replaced while stuck) must not take the spare processes it
    started with it. The child keeps serving after that thread is gone."""
    import pickle

    from radixserve.grammar.workers import FAILED, CompileProcess

    started = []

    def start() -> None:
        proc = CompileProcess(pickle.dumps((None, (0, 0))))  # no backend: every compile fails, answered
        started.append((proc, threading.get_native_id(), proc.wait_ready()))  # booted: its signal set-up ran

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    proc, tid, ready = started[0]
    try:
        assert ready
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
            time.sleep(0.01)  # the OS thread's exit (the signal goes then) follows the join shortly
        assert not os.path.exists(f"/proc/self/task/{tid}")
        answer = proc.compile("regex", "a")
        assert answer is not None and answer[0] == FAILED, "the compile process died with its starting thread"
        assert proc.popen.poll() is None
    finally:
        proc.close()
