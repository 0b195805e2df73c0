"""For availability probes that check a library's functions against the calls a plugin makes
(:mod:`radixserve.library_calls`).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "LibraryCall": "radixserve.library_calls",
    "call_refusal": "radixserve.library_calls",
    "check_calls": "radixserve.library_calls",
    "mismatch_reason": "radixserve.library_calls",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
