"""Every request field of the installed ``sglang`` package is either implemented (declared on
our bodies or sampling parameters) or listed in :mod:`radixserve_server.sglang_fields`, and
the README's field table lists those lists."""

from __future__ import annotations

import os

import pytest
from radixserve.sampling import SamplingParams
from radixserve_server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve_server.sglang_fields import DEFAULT_ONLY, NOOP

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
SGLANG_INTERNAL = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
                   "ebnf_full_assistant"}  # set by SGLang's own normalisation, never by a client


def known(body) -> set[str]:
    return set(body.model_fields) | set(NOOP) | set(DEFAULT_ONLY)


def test_every_generate_field_of_sglang_is_known():
    """Read from the source: importing SGLang's io_struct needs its GPU-side packages."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (scripts/install.sh installs it)")
    path = os.path.join(os.path.dirname(spec.origin), "srt", "managers", "io_struct.py")
    with open(path) as fh:
        tree = ast.parse(fh.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert len(fields) > 50
    assert fields - known(GenerateRequest) == set()


def test_every_sampling_field_of_sglang_is_known():
    sp = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang is not installed")
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(sp.SamplingParams)} - SGLANG_INTERNAL
    assert fields - set(SamplingParams.field_names()) == set()


def test_every_openai_extra_of_sglang_is_known():
    proto = pytest.importorskip("sglang.srt.entrypoints.openai.protocol", reason="sglang is not installed")
    for theirs, ours in ((proto.ChatCompletionRequest, ChatCompletionRequest),
                         (proto.CompletionRequest, CompletionRequest)):
        fields = {n for n in theirs.model_fields if not n.startswith("_")}
        assert fields - known(ours) == set(), theirs.__name__


def test_readme_table_lists_every_listed_field():
    with open(README) as fh:
        text = fh.read()
    for name in list(NOOP) + list(DEFAULT_ONLY):
        assert f"| {name} |" in text, name


def test_implemented_fields_are_not_listed_as_unsupported():
    """A field the bodies implement (LoRA's lora_path) is not also refused by the tables."""
    for body in (GenerateRequest, ChatCompletionRequest, CompletionRequest):
        assert "lora_path" in body.model_fields
    assert "lora_path" not in DEFAULT_ONLY and "lora_path" not in NOOP
