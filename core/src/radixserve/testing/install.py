"""Installing a plugin distribution into a directory of its own, for tests that run
radixserve in a subprocess with that plugin (``PYTHONPATH=<dir>``) while the test's own
interpreter never imports it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def install_plugin(source: str | Path, base: str | Path) -> Path:
    """``pip install --target`` the distribution at ``source`` (built from a copy, so its
    tree stays clean) under ``base``; returns the directory to put on ``PYTHONPATH``."""
    base = Path(base)
    src = base / "src"
    shutil.copytree(source, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = base / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"installing {source} failed:\n{proc.stdout}{proc.stderr}")
    return site


def pythonpath_with(site: str | Path) -> str:
    """``PYTHONPATH`` with ``site`` in front of whatever is set already."""
    current = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(site)] + ([current] if current else []))
