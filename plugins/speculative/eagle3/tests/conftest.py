"""The repository's ``tests/`` (tiny random checkpoints) and ``scripts/`` (the trainer)
become importable, and every test gets a tiny random Llama target with 8 layers (so the
default aux layers [1, 3, 4] are distinct)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
for sub in ("tests", "scripts"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny matrices: one torch thread is as fast, and on a busy machine two threads
    waiting on each other at every op can be a hundred times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """(directory, transformers model) of a tiny random 8-layer Llama."""
    from tiny_models import build_checkpoint

    path = str(tmp_path_factory.mktemp("eagle3-target"))
    model = build_checkpoint(path, "llama", seed=3, num_hidden_layers=8)
    return path, model
