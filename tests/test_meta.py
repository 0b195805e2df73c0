"""Meta-tests: every hook is documented, tested and reachable from a plugin kind.

Adding a hookspec without a docstring, a ``## <hook>`` section in docs/plugins.md, a test
that names it, or a ``registry.KINDS`` entry makes one of these fail.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from radixserve import hookspecs
from radixserve.registry import KINDS, Registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "plugins.md"
TESTS = Path(__file__).resolve().parent


def _hookspec_names() -> list[str]:
    pm = Registry().pm
    names = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if fn.__module__ == hookspecs.__name__ and getattr(pm.hook, name, None) is not None
             and getattr(pm.hook, name).has_spec()]
    assert names, "found no hookspecs"
    return names


HOOKS = _hookspec_names()


def test_hookspecs_are_found():
    assert "register_attention_backends" in HOOKS and "register_commands" in HOOKS
    assert all(name.startswith("register_") for name in HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_has_a_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and doc.strip(), f"hookspec {hook} has no docstring"


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_is_documented(hook):
    headings = re.findall(r"^## (\S+)\s*$", DOCS.read_text(), re.M)
    assert hook in headings, f"docs/plugins.md has no '## {hook}' section"


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_is_tested(hook):
    files = [p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name]
    users = [p.name for p in files if re.search(rf"\b{hook}\b", p.read_text())]
    assert users, f"no test under tests/ mentions {hook}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_has_a_hookspec(kind):
    assert KINDS[kind].hook in HOOKS, f"kind {kind!r} names {KINDS[kind].hook}, which is not a hookspec"


def test_every_hookspec_has_a_kind():
    assert sorted(k.hook for k in KINDS.values()) == sorted(HOOKS)


def test_kind_flags_are_engine_flags():
    from radixserve.config import ServerArgs, flag_of

    flags = {flag_of(f) for f in ServerArgs.__dataclass_fields__}
    for kind in KINDS.values():
        assert set(kind.flags) <= flags, kind


def test_core_never_imports_a_plugin():
    pattern = re.compile(r"^\s*(?:from|import)\s+(radixserve_\w+)", re.M)
    offenders = {}
    for path in (ROOT / "core" / "src" / "radixserve").rglob("*.py"):
        found = pattern.findall(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"core imports plugin modules: {offenders}"
