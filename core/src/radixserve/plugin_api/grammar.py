"""For grammar backends (``register_grammar_backends``)."""

from radixserve.grammar import GrammarBackend, GrammarError, GrammarMatcher

__all__ = ["GrammarBackend", "GrammarError", "GrammarMatcher"]
