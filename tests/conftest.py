"""Shared fixtures: the default engine and Hugging Face transformers as the oracle.

All session-scoped, so the default GGUF checkpoint is loaded at most once by our engine
and once by transformers however many test modules use it. Every test is followed by a
check that every engine still alive went back to idle with every KV page and request slot
returned.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

# OpenMP threads waiting at a barrier sleep instead of spinning: set before anything loads
# torch (and its libgomp), inherited by every subprocess. With other jobs on the machine a
# spinning thread burns its core while the thread it waits for is descheduled: a 12-prompt
# greedy batch of the default model took 20-30 s instead of 3-6 s on 2 loaded cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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


_GGUF_READERS: dict[str, object] = {}


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers loads a GGUF checkpoint: gguf-py's reader parses each file once
    per session, and its tensor-name map is built once per (architecture, layers).

    transformers parses the whole header with gguf-py's ``GGUFReader`` for the config, again
    for the weights and again for the tokenizer (~4 s each for the default model's 49k-token
    vocabulary), and rebuilds ``get_tensor_name_map`` for every submodule (~400 times). Both
    are pure functions of their arguments and only read; the weights are still dequantised
    and the model still built and run by transformers itself."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        if mode != "r":
            return reader_class(path, mode)
        key = os.path.realpath(path)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = reader_class(path, mode)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@pytest.fixture(scope="session")
def hf_default_model(default_model_file):
    from transformers import AutoModelForCausalLM

    directory, name = default_model_file
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_file):
    from transformers import AutoTokenizer

    directory, name = default_model_file
    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def default_prompts(hf_default_tokenizer) -> list[str]:
    """The 20 transformers-equality prompts of test_default_model (chats through the model's
    template)."""
    from test_default_model import CHAT_CONVERSATIONS, PLAIN_PROMPTS

    chats = [hf_default_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in CHAT_CONVERSATIONS]
    return PLAIN_PROMPTS + chats


@pytest.fixture(scope="session")
def default_greedy_outputs(default_engine, default_prompts) -> list[dict]:
    """The default engine's greedy outputs for ``default_prompts``, all in one ``generate``
    call (test_default_model's GREEDY: 64 new tokens). Computed once per session:
    test_default_model checks them against transformers, other modules compare with them as
    plain decoding. Read only."""
    from test_default_model import GREEDY

    return default_engine.generate(default_prompts, GREEDY)
