"""The llguidance grammar backend through the shared structured-output suite, on the default model."""

from __future__ import annotations

from radixserve.testing.grammar_suite import GrammarBackendSuite
from radixserve_grammar_llguidance import LLGuidanceBackend


class TestLLGuidance(GrammarBackendSuite):
    backend = "llguidance"
    backend_class = LLGuidanceBackend
    distribution = "radixserve-grammar-llguidance"
