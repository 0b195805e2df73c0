"""Sampling defaults: a checkpoint's generation_config.json (``--sampling-defaults model``)
and ``--preferred-sampling-params`` fill the sampling fields a request leaves out; a field
the request gives always wins; ``--sampling-defaults openai`` and GGUF files change nothing."""

from __future__ import annotations

import json
import os

import pytest
import radixserve
from radixserve.config import ConfigError, ServerArgs
from radixserve.model_loader import load_checkpoint
from radixserve.sampling import SamplingParams
from tiny_models import build_checkpoint

PROMPT = [5, 6, 7, 8]
SILENT = {"max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny Llama whose generation_config.json makes silent requests greedy (top_k 1)."""
    path = str(tmp_path_factory.mktemp("gen_defaults"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=256)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as fh:
        gen = json.load(fh)
    gen.update(top_k=1, top_p=0.9, min_p="high", do_sample=True)  # min_p is invalid: ignored
    with open(gen_path, "w") as fh:
        json.dump(gen, fh)
    return path


def outputs(engine, seeds, **fields):
    return [engine.generate(input_ids=PROMPT, sampling_params=dict(SILENT, seed=s, **fields))["output_ids"]
            for s in seeds]


def test_model_defaults_make_silent_requests_greedy_and_explicit_fields_win(tiny_path):
    assert load_checkpoint(tiny_path).generation_defaults == {"top_k": 1, "top_p": 0.9}
    with radixserve.Engine(tiny_path, dtype="float32", max_total_tokens=2048) as engine:
        assert engine.sampling_defaults == {"top_k": 1, "top_p": 0.9}
        greedy = outputs(engine, [None], temperature=0.0)[0]
        assert outputs(engine, [1, 2]) == [greedy, greedy]
        assert engine.generate(input_ids=PROMPT, sampling_params=None)["output_ids"][:1] == greedy[:1]
        sampled = outputs(engine, [1, 2], top_k=-1)  # the request's own top_k wins
        assert greedy not in sampled and sampled[0] != sampled[1]
        # a SamplingParams object is used as given: no defaults
        given = engine.generate(input_ids=PROMPT, sampling_params=SamplingParams(**SILENT, seed=1))["output_ids"]
        assert given != greedy


def test_openai_defaults_and_preferred_params(tiny_path):
    with radixserve.Engine(tiny_path, dtype="float32", max_total_tokens=2048, sampling_defaults="openai") as engine:
        assert engine.sampling_defaults == {}
        greedy = outputs(engine, [None], temperature=0.0)[0]
        sampled = outputs(engine, [1, 2])
        assert greedy not in sampled
    with radixserve.Engine(tiny_path, dtype="float32", max_total_tokens=2048,
                           preferred_sampling_params='{"top_k": 0, "temperature": 0.5}') as engine:
        # over the model's: top_k 0 (off) replaces its top_k 1, its top_p stays
        assert engine.sampling_defaults == {"top_k": -1, "top_p": 0.9, "temperature": 0.5}
        assert outputs(engine, [1])[0] != outputs(engine, [None], temperature=0.0)[0]


def test_gguf_has_no_defaults_and_bad_flags_are_refused():
    assert load_checkpoint(None).generation_defaults == {}
    with pytest.raises(ConfigError, match="--sampling-defaults"):
        ServerArgs(sampling_defaults="vllm")
    with pytest.raises(ConfigError, match="--preferred-sampling-params: 'max_new_tokens' cannot be preset"):
        ServerArgs(preferred_sampling_params='{"max_new_tokens": 3}')
    with pytest.raises(ConfigError, match="--preferred-sampling-params: top_p must be in"):
        ServerArgs(preferred_sampling_params='{"top_p": 0}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        ServerArgs(preferred_sampling_params="{top_p: 1}")
