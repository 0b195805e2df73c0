"""Kernels plugins may call: radixserve's compiled CPU kernels (``cpu_kernels.load()``: the
library, or None where it cannot be built), ``load_cpu_library(name, sources)`` to build a
plugin's own C kernels the same way (against the core's ``cpu_common.h``), and the Triton
helpers (interpreter mode, availability, ahead-of-time compile checks); ``tape_recording()``:
whether a kernel tape is recording the current forward (a plugin keeps alive what a recorded
call reads at every replay).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "cpu_kernels": "radixserve.kernels.cpu",
    "load_cpu_library": "radixserve.kernels.cpu:load_library",
    "compile_for_arch": "radixserve.kernels.triton_support",
    "interpreter_enabled": "radixserve.kernels.triton_support",
    "triton_unavailable_reason": "radixserve.kernels.triton_support",
    "tape_recording": "radixserve.kernels.tape:recording",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
