"""The structured-output test suite every grammar-backend plugin runs, as a pytest class.

A plugin's test module subclasses :class:`GrammarBackendSuite` and names its backend::

    from radixserve.testing.grammar_suite import GrammarBackendSuite
    from my_plugin import MyBackend

    class TestMyBackend(GrammarBackendSuite):
        backend = "mine"
        backend_class = MyBackend
        distribution = "my-plugin-dist"

The checks themselves live in :mod:`radixserve.testing.grammar_conformance`. Needs pytest.
"""

from __future__ import annotations

import pytest

from radixserve.testing import grammar_conformance as gc


class GrammarBackendSuite:
    backend: str
    backend_class: type
    distribution: str

    @pytest.fixture(scope="class")
    def engine(self):
        """One torch thread: on a shared 2-core machine a busy neighbour makes OpenMP's
        spinning threads many times slower (restored afterwards; the setting is global)."""
        import torch

        import radixserve

        threads = torch.get_num_threads()
        eng = radixserve.Engine(grammar_backend=self.backend, max_total_tokens=4096, num_threads=1)
        try:
            yield eng
        finally:
            eng.shutdown()
            torch.set_num_threads(threads)

    @pytest.fixture(autouse=True)
    def _left_idle(self, request):
        """Every test leaves the engine idle: no page, slot or request held."""
        yield
        if "engine" in request.fixturenames:
            request.getfixturevalue("engine").check_idle_invariant()

    def test_registered_under_entry_point(self):
        from radixserve.registry import Registry

        reg = Registry()
        reg.load_entry_points()
        entry = reg.get("grammar", self.backend)
        assert entry.distribution == self.distribution
        assert entry.factory is self.backend_class
        assert entry.is_available

    def test_engine_uses_it(self, engine):
        assert engine.scheduler.grammar.backend.name == self.backend

    def test_matcher_contract(self, engine):
        gc.check_matcher_contract(self.backend_class, engine.tokenizer.hf,
                                  sorted(engine.scheduler.eos_token_ids))

    def test_compiles_in_worker_processes(self, engine):
        """Serialization round trip; the engine then compiles in killable processes."""
        if not gc.check_serialization(self.backend_class, engine.tokenizer.hf,
                                      sorted(engine.scheduler.eos_token_ids)):
            pytest.skip(f"{self.backend} compiles on threads (no serialize/deserialize): a compile "
                        "past --grammar-compile-timeout cannot be stopped")
        assert engine.scheduler.grammar.processes is not None

    @pytest.mark.parametrize("case", gc.SCHEMAS, ids=lambda c: c[0])
    def test_json_schema_samples_validate(self, engine, case):
        gc.check_json_schema(engine, case)

    def test_json_object(self, engine):
        gc.check_json_object(engine)

    def test_runaway_json_ends(self, engine):
        gc.check_runaway_bounded(engine)

    @pytest.mark.parametrize("case", gc.REGEXES, ids=lambda c: c[0])
    def test_regex_samples_fullmatch(self, engine, case):
        gc.check_regex(engine, case)

    @pytest.mark.parametrize("case", gc.EBNFS, ids=lambda c: c[0])
    def test_ebnf_samples_parse(self, engine, case):
        gc.check_ebnf(engine, case)

    def test_every_sampler_setting(self, engine):
        gc.check_sampler_settings(engine)

    def test_mixed_batch_keeps_free_greedy_tokens(self, engine):
        gc.check_mixed_batch(engine)

    @pytest.mark.parametrize("case", gc.INVALID, ids=lambda c: c[0])
    def test_invalid_grammar_fails_only_its_request(self, engine, case):
        gc.check_invalid(engine, case)

    def test_compiled_grammars_are_cached(self, engine):
        gc.check_cache(engine)
