"""Run the ``radixserve`` command in a subprocess where loading a checkpoint is an error.

Flag and address checks must happen before the model loads. Timing the command cannot show
that on a noisy machine; this runner can: ``load_checkpoint`` is replaced, before anything
imports it, by a function that prints :data:`LOADED` and exits with :data:`LOADED_EXIT`, so a
check that runs too late turns into a distinct exit status and a line on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys

from radixserve.registry import ALLOWLIST_ENV

LOADED = "cli_guard: load_checkpoint was called"
LOADED_EXIT = 97

_BOOT = f"""
import sys
import radixserve.model_loader as _pkg
import radixserve.model_loader.loader as _mod

def _refuse(*args, **kwargs):
    print({LOADED!r}, file=sys.stderr, flush=True)
    raise SystemExit({LOADED_EXIT})

_pkg.load_checkpoint = _mod.load_checkpoint = _refuse
from radixserve.cli import main
sys.argv[0] = "radixserve"
sys.exit(main(sys.argv[1:]))
"""


def run_without_loading(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``radixserve ARGS`` with checkpoint loading forbidden (and no plugin allow-list)."""
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    return subprocess.run([sys.executable, "-c", _BOOT, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def assert_not_loaded(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode != LOADED_EXIT and LOADED not in proc.stderr, (
        f"the checkpoint was loaded before the error was found:\n{proc.stderr}")
