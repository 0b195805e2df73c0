"""The llguidance grammar backend: the matcher contract and the shared structured-output
conformance suite (radixserve.testing.grammar_conformance) on the default model."""

from __future__ import annotations

import pytest
from radixserve.testing import grammar_conformance as gc
from radixserve_grammar_llguidance import LLGuidanceBackend

BACKEND = "llguidance"


@pytest.fixture(scope="module")
def engine():
    """One torch thread: on a shared 2-core machine a busy neighbour makes OpenMP's
    spinning threads many times slower (restored afterwards; the setting is global)."""
    import radixserve
    import torch

    threads = torch.get_num_threads()
    eng = radixserve.Engine(grammar_backend=BACKEND, max_total_tokens=4096, num_threads=1)
    try:
        yield eng
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _left_idle(request):
    """Every test leaves the engine idle: no page, slot or request held."""
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").check_idle_invariant()


def test_registered_under_entry_point():
    from radixserve.registry import Registry

    reg = Registry()
    reg.load_entry_points()
    entry = reg.get("grammar", BACKEND)
    assert entry.distribution == "radixserve-grammar-llguidance"
    assert entry.factory is LLGuidanceBackend
    assert entry.is_available


def test_engine_uses_it(engine):
    assert engine.scheduler.grammar.backend.name == BACKEND


def test_matcher_contract(engine):
    gc.check_matcher_contract(LLGuidanceBackend, engine.tokenizer.hf, sorted(engine.scheduler.eos_token_ids))


@pytest.mark.parametrize("case", gc.SCHEMAS, ids=lambda c: c[0])
def test_json_schema_samples_validate(engine, case):
    gc.check_json_schema(engine, case)


def test_json_object(engine):
    gc.check_json_object(engine)


@pytest.mark.parametrize("case", gc.REGEXES, ids=lambda c: c[0])
def test_regex_samples_fullmatch(engine, case):
    gc.check_regex(engine, case)


@pytest.mark.parametrize("case", gc.EBNFS, ids=lambda c: c[0])
def test_ebnf_samples_parse(engine, case):
    gc.check_ebnf(engine, case)


def test_every_sampler_setting(engine):
    gc.check_sampler_settings(engine)


def test_mixed_batch_keeps_free_greedy_tokens(engine):
    gc.check_mixed_batch(engine)


@pytest.mark.parametrize("case", gc.INVALID, ids=lambda c: c[0])
def test_invalid_grammar_fails_only_its_request(engine, case):
    gc.check_invalid(engine, case)


def test_compiled_grammars_are_cached(engine):
    gc.check_cache(engine)
