"""The xgrammar grammar backend through the shared structured-output suite, on the default model."""

from __future__ import annotations

from radixserve.testing.grammar_suite import GrammarBackendSuite
from radixserve_grammar_xgrammar import XGrammarBackend


class TestXGrammar(GrammarBackendSuite):
    backend = "xgrammar"
    backend_class = XGrammarBackend
    distribution = "radixserve-grammar-xgrammar"
