"""The availability probes against fake builds of the libraries (``fake_flash.py``) on a
simulated CUDA machine: the targeted builds pass; older ones, and a build whose version
string is new enough but whose functions are not, are refused with the version found, the
version needed and the missing parameters. And scripts/availability.py's lines and exit
status, which scripts/gpu_check.sh acts on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from fake_flash import (
    FA3_2024_11,
    FA3_2025_01,
    FA3_2025_08,
    FA2_v2_5_6,
    FA2_v2_5_9,
    FA2_v2_8_3,
    install_fa2,
    install_fa3,
)
from radixserve_attention_flash_attn import probes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "availability.py"


@pytest.fixture
def hopper(monkeypatch):
    """torch.cuda as on a one-GPU Hopper machine (the probes launch nothing); no flash_attn_3
    distribution, as where the fakes stand in."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_distribution)


def test_targeted_builds_pass(monkeypatch, hopper):
    install_fa2(monkeypatch)
    install_fa3(monkeypatch)
    assert probes.fa2_unavailable_reason() is None
    assert probes.fa3_unavailable_reason() is None
    for version in ("2.6.0", "2.7.4.post1", "2.8.3+cu12torch2.7cxx11abiTRUE", "2.8.4"):
        install_fa2(monkeypatch, version=version)
        assert probes.fa2_unavailable_reason() is None, version


def test_fa2_2_5_6_refused_for_its_version_and_its_varlen(monkeypatch, hopper):
    """2.5.0-2.5.6 passed the old ``>= 2.5`` gate, yet their flash_attn_varlen_func takes no
    block_table."""
    install_fa2(monkeypatch, FA2_v2_5_6)
    reason = probes.fa2_unavailable_reason()
    assert reason.startswith("flash-attn 2.5.6 is too old: fa2 needs flash-attn 2.6.0+"), reason
    assert "block_table" in reason and "pip install 'flash-attn>=2.6'" in reason


def test_fa2_2_5_9_refused_for_its_lse_layout(monkeypatch, hopper):
    """block_table is there (since 2.5.7) but the log-sum-exp is still per padded batch."""
    install_fa2(monkeypatch, FA2_v2_5_9)
    assert probes.signature_gaps(sys.modules["flash_attn"], probes.FA2_CALLS) == []
    reason = probes.fa2_unavailable_reason()
    assert "flash-attn 2.5.9.post1 is too old" in reason and "2.6.0+" in reason
    assert "[heads, total_q] from 2.6.0" in reason


def test_fa2_with_a_new_version_but_old_functions_names_what_is_missing(monkeypatch, hopper):
    install_fa2(monkeypatch, FA2_v2_5_6, version="2.8.3")
    reason = probes.fa2_unavailable_reason()
    assert reason.startswith("flash-attn 2.8.3 lacks what fa2 calls: flash_attn_varlen_func has no "
                             "parameter block_table"), reason
    assert "2.6.0+" in reason
    install_fa2(monkeypatch, FA2_v2_8_3, version=None)
    reason = probes.fa2_unavailable_reason()
    assert "flash-attn reports no version (__version__ = None)" in reason and "2.6.0+" in reason


def test_fa3_without_return_attn_probs_refused(monkeypatch, hopper):
    """Builds from 2025-01-07 to 2025-08-29: paged, ragged flash_attn_with_kvcache, but no
    log-sum-exp from flash_attn_varlen_func (the gather path's target verify needs it)."""
    install_fa3(monkeypatch, FA3_2025_08)
    reason = probes.fa3_unavailable_reason()
    assert reason.startswith("FlashAttention-3 (flash_attn_interface, version unknown) lacks what fa3 calls: "
                             "flash_attn_varlen_func has no parameter return_attn_probs;"), reason
    assert "2025-08-29 or later (commit 203b9b3d" in reason


def test_fa3_with_varlen_lengths_in_another_order_refused(monkeypatch, hopper):
    """Builds of 2025-01-07 to 2025-02-15 took seqused_q, seqused_k as the 6th and 7th positional
    parameters, where fa3 passes max_seqlen_q, max_seqlen_k."""
    install_fa3(monkeypatch, FA3_2025_01)
    reason = probes.fa3_unavailable_reason()
    assert ("flash_attn_varlen_func takes (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) first, "
            "not (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); flash_attn_varlen_func has no "
            "parameter return_attn_probs;") in reason, reason
    assert "flash_attn_with_kvcache" not in reason.split("; fa3 needs")[0]


def test_fa3_without_page_table_refused(monkeypatch, hopper):
    install_fa3(monkeypatch, FA3_2024_11, version="3.0.0b1")
    reason = probes.fa3_unavailable_reason()
    assert reason.startswith("FlashAttention-3 (flash_attn_interface, flash_attn_3 3.0.0b1) lacks what fa3 calls")
    assert "flash_attn_with_kvcache has no parameter page_table, cu_seqlens_q, max_seqlen_q;" in reason
    assert "flash_attn_varlen_func has no parameter return_attn_probs" in reason
    assert "commit 7a802796, 2025-01-07" in reason


def test_fa3_version_from_the_distribution(monkeypatch, hopper):
    install_fa3(monkeypatch, FA3_2025_08)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"flash_attn_3": "3.0.0"}[name])
    assert probes.fa3_unavailable_reason().startswith("FlashAttention-3 (flash_attn_interface, flash_attn_3 3.0.0)")


def test_signature_gaps():
    """A function missing, positional parameters in another order, keywords missing; a
    function with **kwargs takes any keyword."""
    calls = {"f": (("q", "k"), ("scale", "causal")), "g": (("q",), ("x",))}

    def f_swapped(k, q, scale=None):
        pass

    def f_open(q, k, **kwargs):
        pass

    lib = type(sys)("lib")
    lib.f = f_swapped
    assert probes.signature_gaps(lib, calls) == [
        "f takes (k, q) first, not (q, k)", "f has no parameter causal", "no function g"]
    lib.f, lib.g = f_open, lambda q, *, x=0: None
    assert probes.signature_gaps(lib, calls) == []
    lib.g = lambda q, /, x=0: None
    assert probes.signature_gaps(lib, {"g": (("q",), ("q", "x"))}) == ["g has no parameter q"]


def test_parse_version():
    assert probes.parse_version("2.5.9.post1") == (2, 5, 9)
    assert probes.parse_version("2.8.3+cu12torch2.7cxx11abiTRUE") == (2, 8, 3)
    assert probes.parse_version("2.6") == (2, 6, 0)
    assert probes.parse_version(None) is None and probes.parse_version("dev") is None


# ------------------------------------------------------------------ scripts/availability.py
def _availability():
    spec = importlib.util.spec_from_file_location("flash_attn_availability", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_availability_passes_when_the_installed_libraries_run(monkeypatch, hopper, capsys):
    install_fa2(monkeypatch)
    install_fa3(monkeypatch)
    assert _availability().main() == 0
    assert capsys.readouterr().out.splitlines() == ["fa3: available", "fa2: available"]


def test_availability_fails_when_an_installed_library_is_refused(monkeypatch, hopper, capsys):
    install_fa2(monkeypatch, FA2_v2_5_6)
    install_fa3(monkeypatch)
    assert _availability().main() == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fa3: available"
    assert lines[1].startswith("fa2: unavailable: flash-attn 2.5.6 is too old: fa2 needs flash-attn 2.6.0+")
    # a Hopper build on an Ampere GPU: installed, so a failure too
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    install_fa2(monkeypatch)
    assert _availability().main() == 1
    assert capsys.readouterr().out.startswith("fa3: unavailable: needs a Hopper GPU (compute capability 9.x), "
                                              "this GPU is 8.0")


def test_availability_says_not_installed_when_neither_library_is(monkeypatch, hopper, capsys):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not found, as where it is not installed
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    assert _availability().main() == 4
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fa3: not installed: FlashAttention-3 (module flash_attn_interface) is not "
                               "importable")
    assert lines[1].startswith("fa2: not installed: flash-attn is not importable")
    assert lines[-1].startswith("not installed")
    install_fa3(monkeypatch)  # one library, running: its tests run, the other's skip
    assert _availability().main() == 0
