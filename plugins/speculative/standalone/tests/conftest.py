"""The repository's ``tests/`` (tiny random checkpoints) becomes importable, and the tiny
target and its drafts are built once per session."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    """A tiny random 4-layer Llama: the target."""
    from tiny_models import build_checkpoint

    path = str(tmp_path_factory.mktemp("standalone-target"))
    build_checkpoint(path, "llama", seed=3, num_hidden_layers=4, max_position_embeddings=512)
    return path


@pytest.fixture(scope="session")
def drafts(tiny, tmp_path_factory) -> dict[str, str]:
    """Draft checkpoints for ``tiny``: itself, its first 2 layers, an unrelated random model
    with the same vocabulary, and one with another vocabulary."""
    from radixserve_speculative_standalone import write_layerskip_draft
    from tiny_models import build_checkpoint

    other = str(tmp_path_factory.mktemp("standalone-other"))
    build_checkpoint(other, "llama", seed=11, num_hidden_layers=1, max_position_embeddings=512)
    vocab = str(tmp_path_factory.mktemp("standalone-vocab"))
    build_checkpoint(vocab, "llama", seed=11, num_hidden_layers=1, vocab_size=320)
    skip = write_layerskip_draft(tiny, str(tmp_path_factory.mktemp("standalone-layerskip")), 2)
    return {"self": tiny, "layerskip": skip, "other": other, "vocab": vocab}
