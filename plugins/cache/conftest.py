"""Shared by the cache tiers' engine tests: the repository's ``tests/`` (tiny random
checkpoints, the idle check) becomes importable, and one tiny Llama is built per session."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    from tiny_models import build_checkpoint

    path = str(tmp_path_factory.mktemp("cache-tier-llama"))
    build_checkpoint(path, "llama", seed=8, max_position_embeddings=512)
    return path
