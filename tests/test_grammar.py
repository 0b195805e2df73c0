"""Structured output in the core: request fields, response_format, bitmasks, and the
scheduler's grammar path (compile off the critical path, cache, time limit, failures)
driven by a throwaway backend that forces a given token sequence.

The real backends (xgrammar, llguidance) run the shared conformance suite in their own
packages' tests (plugins/grammar/*/tests).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.request import Req
from radixserve.grammar import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarError,
    allocate_token_bitmask,
    apply_token_bitmask_,
    constraint_from_response_format,
    grammar_key,
)
from radixserve.grammar.manager import resolve_grammar_backend
from radixserve.hookspecs import hookimpl
from radixserve.registry import Registry, UnknownBackendError
from radixserve.sampling import InvalidSamplingParams, Sampler, SamplingBatchInfo, SamplingParams
from radixserve.testing.forced_grammar import ForcedMatcher, set_bit

GATES: dict[str, threading.Event] = {}


class ForcedBackend(GrammarBackend):
    """``regex`` text ``"5,6,7"`` forces those tokens then end-of-sequence.

    ``"wait:<gate>|5,6"`` blocks compiling until ``GATES[gate]`` is set; ``"bad..."`` fails
    to compile; ``"reject:5"`` builds a matcher that refuses every token."""

    name = "forced"

    def __init__(self, tokenizer, vocab_size, eos_token_ids):
        assert vocab_size >= len(tokenizer)
        self.eos = list(eos_token_ids)
        self.compiled_texts: list[str] = []  # every compile, by text (other tests' run late)

    def compile(self, kind, text):
        self.compiled_texts.append(text)
        if text.startswith("wait:"):
            gate, _, text = text[5:].partition("|")
            GATES[gate].wait(30)
        if text.startswith("bad"):
            raise GrammarError(f"forced: cannot compile {text!r}")
        reject = text.startswith("reject:")
        return [int(x) for x in text.removeprefix("reject:").split(",")], reject

    def new_matcher(self, compiled):
        ids, reject = compiled
        return ForcedMatcher(ids, self.eos, reject)


class ForcedPlugin:
    @staticmethod
    @hookimpl
    def register_grammar_backends(register):
        register("forced", ForcedBackend, description="test backend forcing token ids")


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(ForcedPlugin, name="forced-grammar", distribution="tests")
    try:
        yield reg
    finally:
        reg.remove_plugin("forced-grammar")


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """This module's engines use one torch thread (on a shared 2-core machine a busy
    neighbour makes OpenMP's spinning threads many times slower); the setting is global,
    so it is restored for the modules that follow."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(registry):
    import radixserve

    eng = radixserve.Engine(registry=registry, grammar_backend="forced", max_total_tokens=2048,
                            num_threads=1)
    yield eng
    eng.shutdown()


def forced(ids: list[int], prefix: str = "") -> str:
    return prefix + ",".join(str(t) for t in ids)


WORDS = [28120, 905, 28, 1485]  # any ids in the vocabulary will do


# ----------------------------------------------------------- request fields
def test_sampling_params_take_one_constraint():
    p = SamplingParams.from_dict({"json_schema": '{"type": "string"}'})
    assert p.json_schema == '{"type": "string"}' and p.has_constraint
    assert not SamplingParams.from_dict({}).has_constraint
    with pytest.raises(InvalidSamplingParams, match=r"json_schema and regex cannot be combined") as e:
        SamplingParams.from_dict({"json_schema": "{}", "regex": "a"})
    assert e.value.param == "json_schema"
    with pytest.raises(InvalidSamplingParams, match=r"regex and ebnf cannot be combined"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})


@pytest.mark.parametrize("field,value", [
    ("json_schema", {"type": "object"}), ("regex", 5), ("ebnf", ["root ::= x"]), ("regex", True),
])
def test_sampling_params_reject_non_string_constraints(field, value):
    with pytest.raises(InvalidSamplingParams, match=rf"^{field} must be a string") as e:
        SamplingParams.from_dict({field: value})
    assert e.value.param == field


def test_grammar_key():
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(regex="a+")) == ("regex", "a+")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')
    schema = '{"type": "array"}'
    assert grammar_key(SamplingParams(json_schema=schema)) == ("json_schema", schema)
    assert grammar_key(SamplingParams(json_schema='{"type":"object"}')) == ("json_object", "")
    assert grammar_key(SamplingParams(json_schema="{bad")) == ("json_schema", "{bad")


def test_response_format_mapping():
    assert constraint_from_response_format(None) == {}
    assert constraint_from_response_format({"type": "text"}) == {}
    assert constraint_from_response_format({"type": "json_object"}) == {"json_schema": JSON_OBJECT_SCHEMA}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    got = constraint_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    assert json.loads(got["json_schema"]) == schema
    assert grammar_key(SamplingParams(**constraint_from_response_format({"type": "json_object"}))) \
        == ("json_object", "")


@pytest.mark.parametrize("bad,match", [
    ("json_object", "expected an object"),
    ({"type": "xml"}, "type must be one of"),
    ({}, "type must be one of"),
    ({"type": "json_schema"}, "needs a 'json_schema' object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be true or false"),
])
def test_response_format_rejects_bad_shapes(bad, match):
    with pytest.raises(InvalidSamplingParams, match=match) as e:
        constraint_from_response_format(bad)
    assert e.value.param == "response_format"


def test_compile_timeout_flag():
    assert ServerArgs().grammar_compile_timeout > 0
    for bad in (0, -1.0, "5", True, float("inf")):
        with pytest.raises(ConfigError, match="--grammar-compile-timeout"):
            ServerArgs(grammar_compile_timeout=bad)
    with pytest.raises(ConfigError, match="--grammar-backend"):
        ServerArgs(grammar_backend="")


# ------------------------------------------------------------------ bitmasks
def test_apply_token_bitmask_matches_a_boolean_mask():
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32
    allowed = torch.rand(3, vocab, generator=gen) < 0.3  # [B, V]
    bitmask = allocate_token_bitmask(3, vocab)
    bitmask.zero_()
    for row, tok in allowed.nonzero().tolist():
        set_bit(bitmask, row, tok)
    logits = torch.randn(3, vocab, generator=gen)
    masked = apply_token_bitmask_(logits.clone(), bitmask)
    assert torch.equal(masked, logits.masked_fill(~allowed, float("-inf")))
    full = allocate_token_bitmask(3, vocab)
    assert torch.equal(apply_token_bitmask_(logits.clone(), full), logits)
    wider = torch.randn(3, 100, generator=gen)  # tokens past the mask's width are forbidden
    out = apply_token_bitmask_(wider.clone(), full)
    assert torch.isinf(out[:, 96:]).all() and torch.equal(out[:, :96], wider[:, :96])


@pytest.mark.parametrize("setting", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 2.0, "top_p": 0.5},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "min_p": 0.3},
    {"temperature": 1.0, "repetition_penalty": 2.0, "frequency_penalty": 2.0, "presence_penalty": 2.0},
    {"temperature": 0.0, "repetition_penalty": 1.5, "return_logprob": True, "top_logprobs_num": 2},
], ids=str)
def test_sampler_only_draws_allowed_tokens(setting):
    vocab, batch = 64, 4
    gen = torch.Generator().manual_seed(1)
    allowed = [[3, 40], [63], list(range(vocab)), [0, 31, 32]]  # row 2 is unconstrained
    bitmask = allocate_token_bitmask(batch, vocab)
    for row in (0, 1, 3):
        bitmask[row].zero_()
        for t in allowed[row]:
            set_bit(bitmask, row, t)
    params = [SamplingParams(**setting) for _ in range(batch)]
    for p in params:
        p.verify(vocab)
    logits = torch.randn(batch, vocab, generator=gen) * 5
    before = logits.clone()
    for _ in range(20):
        info = SamplingBatchInfo.build(params, [None] * batch, [([1, 2, 3], [3, 4])] * batch,
                                       [2] * batch, {0}, vocab, "cpu", shared_generator=gen)
        info.vocab_mask = bitmask
        out = Sampler().sample(logits, info)
        for row, tok in enumerate(out.next_token_ids.tolist()):
            assert tok in allowed[row], (row, tok)
        if out.logprobs is not None:
            assert torch.isfinite(out.logprobs).all()
    assert torch.equal(logits, before)  # the caller's logits are untouched


def test_grammar_end_wins_over_min_new_tokens():
    vocab, eos = 64, 5
    bitmask = allocate_token_bitmask(2, vocab)
    bitmask.zero_()
    set_bit(bitmask, 0, eos)  # row 0: the grammar is complete, only EOS may follow
    set_bit(bitmask, 1, 9)
    set_bit(bitmask, 1, eos)
    params = [SamplingParams(temperature=0.0, min_new_tokens=4, repetition_penalty=1.2)
              for _ in range(2)]
    for p in params:
        p.verify(vocab)
    info = SamplingBatchInfo.build(params, [None, None], [([1], [])] * 2, [0, 0], {eos}, vocab, "cpu")
    info.vocab_mask = bitmask
    logits = torch.randn(2, vocab)
    assert Sampler().sample(logits, info).next_token_ids.tolist() == [eos, 9]


# ------------------------------------------------------------ engine start-up
def test_default_backend_is_xgrammar_when_installed(registry):
    entry = resolve_grammar_backend(ServerArgs(), registry)
    if "xgrammar" in registry.names("grammar") and registry.get("grammar", "xgrammar").is_available:
        assert entry.name == "xgrammar"
    else:
        assert entry is None
    assert resolve_grammar_backend(ServerArgs(grammar_backend="none"), registry) is None
    assert resolve_grammar_backend(ServerArgs(grammar_backend="forced"), registry).name == "forced"
    bare = Registry()  # nothing installed: no grammar backend, and that is not an error
    assert resolve_grammar_backend(ServerArgs(), bare) is None


def test_unknown_grammar_backend_fails_before_loading(registry):
    import radixserve

    with pytest.raises(UnknownBackendError, match=r"--grammar-backend.*'nope'.*forced"):
        radixserve.Engine(registry=registry, grammar_backend="nope")


# ------------------------------------------------------------ engine behaviour
def test_forced_tokens_end_with_stop_under_every_sampler_setting(engine):
    settings = [{"temperature": 0.0}, {"temperature": 1.5}, {"temperature": 1.0, "top_p": 0.3},
                {"temperature": 1.0, "top_k": 2}, {"temperature": 1.0, "min_p": 0.5},
                {"temperature": 1.0, "repetition_penalty": 1.8, "frequency_penalty": 1.0,
                 "presence_penalty": 1.0}, {"temperature": 0.9, "seed": 3, "n": 2}]
    params = [{"regex": forced(WORDS), "max_new_tokens": 10, **s} for s in settings]
    outs = engine.generate(["Once upon a time"] * len(settings), params)
    assert len(outs) == len(settings) + 1
    eos = engine.scheduler.eos_token_ids
    for out in outs:
        assert out["output_ids"][:-1] == WORDS and out["output_ids"][-1] in eos, out
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}


def test_grammar_outlasting_max_new_tokens_ends_with_length(engine):
    out = engine.generate("Hi", {"regex": forced(WORDS), "max_new_tokens": 2})
    assert out["output_ids"] == WORDS[:2]
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_free_neighbours_keep_their_greedy_tokens(engine):
    prompts = ["The capital of France is", "1, 2, 3,"]
    free = {"temperature": 0.0, "max_new_tokens": 12}
    alone = engine.generate(prompts, free)
    mixed = engine.generate(
        [prompts[0], "x", prompts[1], "y"],
        [free, {"regex": forced(WORDS[:2]), "max_new_tokens": 12}, free,
         {"regex": forced(WORDS[2:]), "max_new_tokens": 12, "temperature": 1.0}])
    assert mixed[0]["output_ids"] == alone[0]["output_ids"]
    assert mixed[2]["output_ids"] == alone[1]["output_ids"]
    assert mixed[1]["output_ids"][:2] == WORDS[:2] and mixed[3]["output_ids"][:2] == WORDS[2:]


def _req(engine, rid: str, prompt: str, **params) -> Req:
    p = SamplingParams(**params)
    p.verify(engine.model_config.vocab_size)
    return Req(rid, engine.tokenizer.encode(prompt), p, p.max_new_tokens)


def _step_until(sched, cond, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "timed out stepping the scheduler"
        sched.step()


def test_scheduler_serves_others_while_a_grammar_compiles(engine):
    sched = engine.scheduler
    GATES["serve"] = gate = threading.Event()
    slow = _req(engine, "slow", "Hello", regex=forced(WORDS, "wait:serve|"), max_new_tokens=8)
    free = _req(engine, "free", "Hello", temperature=0.0, max_new_tokens=6)
    try:
        sched.add_request(slow)
        sched.add_request(free)
        assert slow in sched.grammar_queue and slow not in sched.waiting
        _step_until(sched, lambda: free.finished)
        assert len(free.output_ids) == 6 and not slow.finished and slow in sched.grammar_queue
        assert slow.req_pool_idx is None and not slow.output_ids  # kept out of every batch
        gate.set()
        _step_until(sched, lambda: slow.finished)
        assert slow.output_ids[:-1] == WORDS and slow.finish_reason["type"] == "stop"
    finally:
        gate.set()
        if not slow.finished:
            sched.abort("slow")


def test_abort_while_compiling(engine):
    sched = engine.scheduler
    GATES["abort"] = gate = threading.Event()
    req = _req(engine, "compiling", "Hello", regex=forced(WORDS, "wait:abort|"), max_new_tokens=8)
    try:
        sched.add_request(req)
        job = req.grammar_job
        assert sched.abort("compiling")
        assert req.finish_reason == {"type": "abort", "message": "aborted"}
        assert not sched.has_work
    finally:
        gate.set()
    assert job.done.wait(10)  # the compile goes on (cached for later requests) and ends


def test_compile_failure_fails_only_its_request_and_is_cached(engine):
    """Compiles are counted by text: a count of all compiles also counted compiles that
    earlier tests left running in the background (the cause of a full-suite failure)."""
    grammar = engine.scheduler.grammar
    params = [{"temperature": 0.0, "max_new_tokens": 5},
              {"regex": "bad grammar 1", "max_new_tokens": 5}]
    ok, bad = engine.generate(["Hello", "Hello"], params)
    assert bad["meta_info"]["finish_reason"] == {
        "type": "abort", "status_code": 400, "message": "forced: cannot compile 'bad grammar 1'"}
    assert bad["output_ids"] == [] and len(ok["output_ids"]) == 5
    hits = grammar.num_cache_hits
    again = engine.generate("Hi", params[1])
    assert again["meta_info"]["finish_reason"] == bad["meta_info"]["finish_reason"]
    assert grammar.backend.compiled_texts.count("bad grammar 1") == 1
    assert grammar.num_cache_hits == hits + 1


def test_matcher_that_rejects_its_own_token_aborts_the_request(engine):
    out = engine.generate("Hi", {"regex": "reject:5", "max_new_tokens": 4})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "rejected token" in reason["message"]


def test_compile_time_limit(engine):
    grammar = engine.scheduler.grammar
    GATES["limit"] = gate = threading.Event()
    old = grammar.compile_timeout
    grammar.compile_timeout = 0.3
    text = forced(WORDS, "wait:limit|")
    try:
        ok, late = engine.generate(["Hello", "Hello"], [{"temperature": 0.0, "max_new_tokens": 3},
                                                        {"regex": text, "max_new_tokens": 8}])
        assert not gate.is_set()  # the compile is still blocked: the time limit ended it
        reason = late["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400
        assert "timed out after 0.3 s" in reason["message"] and "--grammar-compile-timeout" in reason["message"]
        assert len(ok["output_ids"]) == 3
        compiles = grammar.num_compiles
        again = engine.generate("Hi", {"regex": text, "max_new_tokens": 8})  # cached failure
        assert again["meta_info"]["finish_reason"] == reason and grammar.num_compiles == compiles
    finally:
        grammar.compile_timeout = old
        gate.set()


def test_no_backend_rejects_constrained_requests(registry):
    import radixserve

    with radixserve.Engine(registry=registry, grammar_backend="none", max_total_tokens=512,
                           num_threads=1) as eng:
        assert eng.scheduler.grammar is None
        free, constrained = eng.generate(
            ["Hello", "Hello"], [{"max_new_tokens": 3}, {"json_schema": '{"type": "integer"}'}])
        reason = constrained["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400
        assert "--grammar-backend none" in reason["message"]
        assert len(free["output_ids"]) == 3
        eng.check_idle_invariant()


def test_retracted_constrained_requests_resume_where_they_were(registry):
    """Under memory pressure constrained requests are retracted and resumed; their matchers
    keep their state, so the forced tokens come out whole."""
    import radixserve

    ids = [WORDS[i % len(WORDS)] for i in range(40)]
    with radixserve.Engine(registry=registry, grammar_backend="forced", max_total_tokens=160,
                           enable_leak_check=True, num_threads=1) as eng:
        outs = eng.generate(["Hello there"] * 6, {"regex": forced(ids), "max_new_tokens": 48})
        assert eng.get_stats()["num_retractions"] > 0
        for out in outs:
            assert out["output_ids"][:-1] == ids and out["meta_info"]["finish_reason"]["type"] == "stop"
        eng.check_idle_invariant()


# ------------------------------------------------------------- compile pool
def _manager(registry, timeout: float):
    from radixserve.grammar.manager import GrammarManager

    backend = ForcedBackend(list(range(10)), 10, [2])
    return GrammarManager(backend, compile_timeout=timeout, num_workers=2)


def test_stuck_compiles_do_not_starve_the_pool(registry):
    """Two compiles that never end time out; their workers are written off and replaced,
    so the next grammar compiles at once although both threads are still stuck."""
    manager = _manager(registry, 0.2)
    GATES["stuck"] = gate = threading.Event()
    try:
        stuck = [manager.get(("regex", f"wait:stuck|{i}")) for i in (1, 2)]
        deadline = time.monotonic() + 10
        while not all(j.worker is not None for j in stuck):  # both workers are inside compile
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for j in stuck:
            manager.check_timeout(j, now=j.submitted + 1.0)  # past the 0.2 s limit
            assert j.is_done and "timed out" in j.error
        assert manager.stats()["num_grammar_workers_stuck"] == 2
        fresh = manager.get(("regex", "3,4"))
        assert fresh.done.wait(5) and fresh.error is None and fresh.compiled == ([3, 4], False)
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while manager.stats()["num_grammar_workers_stuck"]:  # the stuck threads finish and leave
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(manager._workers) == 2


def test_compile_queue_is_bounded(registry, monkeypatch):
    from radixserve.grammar import manager as manager_mod

    monkeypatch.setattr(manager_mod, "MAX_PENDING_JOBS", 3)
    manager = _manager(registry, 30)
    GATES["queue"] = gate = threading.Event()
    try:
        jobs = [manager.get(("regex", f"wait:queue|{i}")) for i in range(12)]
        refused = [j for j in jobs if j.is_done]
        assert refused and all(j.status_code == 429 and "retry later" in j.error for j in refused)
        assert manager.stats()["num_grammar_compiles_refused"] == len(refused)
        again = manager.get(refused[0].key)  # a refusal is not cached
        assert again is not refused[0]
    finally:
        gate.set()
    for j in jobs:
        if j not in refused:
            assert j.done.wait(10) and j.error is None


def test_a_compile_finishes_once_when_it_races_the_time_limit():
    from radixserve.grammar.manager import CompileJob

    for _ in range(200):
        job = CompileJob(("regex", "x"))
        results = []
        threads = [threading.Thread(target=lambda j=job, r=results: r.append(j._finish(compiled=1))),
                   threading.Thread(target=lambda j=job, r=results: r.append(j._finish(error="late")))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, True]
        assert (job.compiled, job.error) in ((1, None), (None, "late"))
