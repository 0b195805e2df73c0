"""Shared fixtures: the default engine and Hugging Face transformers as the oracle.

All session-scoped, so the default GGUF checkpoint is loaded at most once by our engine
and once by transformers however many test modules use it. Every test is followed by a
check that every engine still alive went back to idle with every KV page and request slot
returned.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
from engine_checks import wait_until_idle

DEFAULT_MAX_TOTAL_TOKENS = 16384


@pytest.fixture(scope="session")
def assert_idle():
    """``assert_idle(engine)``: wait for the engine to drain, then check the idle invariant."""
    return wait_until_idle


@pytest.fixture(scope="session")
def default_model_file() -> tuple[str, str]:
    """(directory, file name) of the default GGUF checkpoint."""
    from radixserve.model_loader import default_model_path

    path = default_model_path()
    return os.path.dirname(path), os.path.basename(path)


@pytest.fixture(scope="session")
def default_engine():
    import radixserve

    engine = radixserve.Engine(max_total_tokens=DEFAULT_MAX_TOTAL_TOKENS)
    yield engine
    engine.shutdown()


_live_engines: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Remember every Engine any test creates, so each can be checked after every test."""
    from radixserve.engine.engine import Engine

    original = Engine.__init__

    def tracked(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _live_engines.add(self)

    Engine.__init__ = tracked
    try:
        yield
    finally:
        Engine.__init__ = original


@pytest.fixture(autouse=True)
def _engines_left_idle(request):
    """After every test, every engine still alive has every page free or cached, nothing
    locked, and every request slot free (the scheduler's idle invariant)."""
    if "default_engine" in request.fixturenames:
        request.getfixturevalue("default_engine")
    yield
    for engine in list(_live_engines):
        wait_until_idle(engine)


@pytest.fixture(scope="session")
def hf_default_model(default_model_file):
    from transformers import AutoModelForCausalLM

    directory, name = default_model_file
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_file):
    from transformers import AutoTokenizer

    directory, name = default_model_file
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)
