"""In-tree plugins (and the out-of-tree example) import from the core only through
``radixserve.plugin_api``, and every name they take from it is one it declares."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = sorted(ROOT.glob("plugins/*/*/src/**/*.py")) + [
    ROOT / "tests/plugins/toy_attention/radixserve_attention_toy.py"]


def core_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of ``radixserve`` or a module under it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "radixserve"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "radixserve":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def test_plugins_import_only_the_plugin_api():
    assert len(PLUGIN_SOURCES) > 40  # every plugin package's sources are seen
    bad = []
    for path in PLUGIN_SOURCES:
        for line, module, names in core_imports(path):
            if module != "radixserve.plugin_api" and not module.startswith("radixserve.plugin_api."):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
                continue
            declared = importlib.import_module(module).__all__
            bad += [f"{path.relative_to(ROOT)}:{line}: {module}.{n} is not declared"
                    for n in names if n not in declared]
    assert not bad, "imports from the core outside the plugin API:\n" + "\n".join(bad)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    src = tmp_path / "p.py"
    src.write_text("import os\nfrom radixserve.models.llama import RMSNorm\n"
                   "from radixserve.plugin_api import hookimpl\nfrom . import x\n")
    assert core_imports(src) == [(2, "radixserve.models.llama", ["RMSNorm"]),
                                 (3, "radixserve.plugin_api", ["hookimpl"])]


@pytest.mark.parametrize("module", ["attention", "moe", "cache", "grammar", "speculative", "kernels"])
def test_every_declared_name_exists(module):
    mod = importlib.import_module(f"radixserve.plugin_api.{module}")
    assert mod.__all__ and all(hasattr(mod, n) for n in mod.__all__)


def test_the_top_module_does_not_import_torch():
    """A plugin's entry point imports hookimpl from it when the registry loads plugins."""
    code = "import sys, radixserve.plugin_api; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
