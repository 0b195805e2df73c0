"""For grammar backends (``register_grammar_backends``).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "GrammarBackend": "radixserve.grammar",
    "GrammarError": "radixserve.grammar",
    "GrammarMatcher": "radixserve.grammar",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
