"""radixserve.library_calls (``radixserve.plugin_api.probes``): a library checked against the
calls a plugin declares: missing functions and methods, calls its signatures refuse (a renamed
keyword, too many positional arguments), methods read off a class (with ``self``) and static
methods (without), compiled functions checked by name only, and the refusal's wording."""

from __future__ import annotations

import types

from radixserve.plugin_api.probes import LibraryCall, call_refusal, check_calls, mismatch_reason

CALLS = (LibraryCall("gemm", 3, ("scale",)), LibraryCall("layout", 0), LibraryCall("gone", 1))


def test_missing_functions_and_refused_calls():
    lib = types.SimpleNamespace(gemm=lambda a, b, out, scale=None: None, layout=lambda: 128)
    assert check_calls(lib, CALLS) == ([ "gone"], [])
    lib.gemm = lambda a, b, out, scales=None: None  # a renamed keyword
    missing, refused = check_calls(lib, CALLS)
    assert missing == ["gone"] and len(refused) == 1
    assert refused[0].startswith("gemm(a, b, out, scales=None)") and "scale" in refused[0]
    lib.gemm = lambda a, b, scale=None: None  # one positional parameter fewer: the third lands on scale
    assert "multiple values for argument 'scale'" in check_calls(lib, CALLS)[1][0]


def test_methods_of_a_class_and_compiled_functions():
    class Buffer:
        def dispatch(self, x, *, async_finish=False):
            return x

        @staticmethod
        def size_hint(n):
            return n

    calls = (LibraryCall("dispatch", 1, ("async_finish",)), LibraryCall("size_hint", 1))
    assert check_calls(Buffer, calls, "Buffer.") == ([], [])
    assert call_refusal(Buffer, LibraryCall("dispatch", 2), "Buffer.").startswith("Buffer.dispatch(")
    class Compiled:  # like a pybind function: no signature Python can read
        __signature__ = "unreadable"

        def __call__(self, *args):
            return None

    assert call_refusal(types.SimpleNamespace(f=Compiled()), LibraryCall("f", 5)) is None  # checked by name only


def test_the_refusal_names_the_build_found_and_the_one_needed():
    assert mismatch_reason("lib 2.0", [], [], "needs lib 3") is None
    reason = mismatch_reason("lib 1.0", ["gone"], ["gemm(a) (too many)"], "the runner needs lib 3")
    assert reason == "the installed lib 1.0 lacks gone and takes other arguments: gemm(a) (too many); " \
                     "the runner needs lib 3"
