"""Availability probes that check what a plugin calls on its library, not only that it imports.

A plugin declares each call it makes on a GPU library as a :class:`LibraryCall` (the
function's name, how many positional arguments the call passes, which keywords); the probe
hands the imported module (or a class of it) to :func:`check_calls`, which lists what is
missing and which calls the installed signatures would refuse, and :func:`mismatch_reason`
turns that into the probe's refusal, naming the version found and the version needed. An
incompatible build is then refused at start-up instead of failing in the first forward pass
with a ``TypeError``. Nothing here imports a library.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LibraryCall:
    """One call a plugin makes: ``name(<num_positional arguments>, **{k: ... for k in keywords})``."""

    name: str
    num_positional: int
    keywords: tuple[str, ...] = ()


def call_refusal(owner: Any, call: LibraryCall, label: str = "") -> str | None:
    """Why ``owner.<call.name>`` would refuse the call's arguments, or None (also when Python cannot
    read its signature: a compiled function's name is all that can be checked). A method read off
    a class gets its ``self``, a static method none."""
    fn = getattr(owner, call.name)
    receiver = []
    if inspect.isclass(owner) and not isinstance(inspect.getattr_static(owner, call.name, None), staticmethod):
        receiver = [None]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*receiver, *([None] * call.num_positional), **dict.fromkeys(call.keywords))
    except TypeError as e:
        return f"{label}{call.name}{sig} ({e})"
    return None


def check_calls(owner: Any, calls, label: str = "") -> tuple[list[str], list[str]]:
    """(the functions of ``calls`` that ``owner`` lacks, the calls its signatures refuse), each
    named with ``label`` first (e.g. ``"Buffer."``)."""
    missing, refused = [], []
    for call in calls:
        if not callable(getattr(owner, call.name, None)):
            missing.append(f"{label}{call.name}")
        elif (why := call_refusal(owner, call, label)) is not None:
            refused.append(why)
    return missing, refused


def mismatch_reason(found: str, missing: list[str], refused: list[str], needed: str) -> str | None:
    """The probe's refusal (None when nothing is missing or refused): ``found`` names the installed
    build, ``needed`` who needs what (the version it was checked against, where to read more)."""
    if not missing and not refused:
        return None
    problems = ([f"lacks {', '.join(missing)}"] if missing else []) + \
        ([f"takes other arguments: {'; '.join(refused)}"] if refused else [])
    return f"the installed {found} {' and '.join(problems)}; {needed}"
