"""The deepep transport with DeepEP's real kernels: at least 2 NVLink-connected sm90 GPUs
and deep_ep installed (skipped otherwise, with the reason). DeepEP's normal (intranode)
kernels take 2, 4 or 8 ranks (``SWITCH_RANKS`` in csrc/kernels/legacy/launch.cuh, and
``Buffer.get_dispatch_config`` has no entry for 1), so one GPU cannot run them.

Each mode runs the a2a conformance suite on bf16 cases with a hidden size DeepEP's
low-latency kernels take, one rank per GPU over NCCL: ``combine(runner(dispatch(x)))``
against the single-rank reference over all experts (bf16 tolerance, 3e-2), the same
check the torch_distributed transport passes. Wherever ``deep_ep`` imports on a GPU (one GPU
is enough, and also when the probe refuses it), the installed ``Buffer``'s signatures are
compared with the ones the CPU tests bind the transport's calls to (deep_ep_signatures.py).
Timings live in benchmarks/bench_gpu.py, not here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math

import pytest
import torch
from deep_ep_signatures import TRANSPORT_METHODS, signature
from radixserve.testing.moe_conformance import A2ACase, run_a2a_cases_on_ranks
from radixserve_a2a_deepep import DeepEPOptions, make_transport, unavailable_reason

REASON = unavailable_reason()
if REASON is None and torch.cuda.device_count() < 2:
    REASON = (f"{torch.cuda.device_count()} GPU(s); DeepEP's intranode kernels need 2, 4 or 8 ranks, one GPU "
              "each")
pytestmark = pytest.mark.gpu
IMPORTABLE = torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None

CASES = [A2ACase(1, 16, 2, 4096, 256, torch.bfloat16), A2ACase(100, 16, 8, 4096, 256, torch.bfloat16),
         A2ACase(256, 64, 8, 2048, 128, torch.bfloat16), A2ACase(0, 16, 2, 4096, 256, torch.bfloat16)]


def _world() -> int:
    count = torch.cuda.device_count()
    return 8 if count >= 8 else 4 if count >= 4 else 2


def make_normal(ctx):
    return make_transport(dataclasses.replace(ctx, options=DeepEPOptions(deepep_mode="normal")))


def make_low_latency(ctx):
    return make_transport(dataclasses.replace(ctx, options=DeepEPOptions(deepep_mode="low_latency")))


def make_auto(ctx):
    return make_transport(dataclasses.replace(ctx, options=DeepEPOptions(deepep_mode="auto")))


@pytest.mark.skipif(REASON is not None, reason=f"deepep: {REASON}")
@pytest.mark.parametrize("factory", [make_normal, make_low_latency, make_auto], ids=lambda f: f.__name__)
def test_conformance_on_gpus(factory):
    # raises AssertionError on any element past the bf16 tolerance, on any rank
    max_err = run_a2a_cases_on_ranks(factory, _world(), CASES, device="cuda", timeout_s=300)
    assert math.isfinite(max_err), f"max abs error {max_err}"


@pytest.mark.skipif(not IMPORTABLE, reason="needs CUDA and an installed deep_ep")
def test_installed_buffer_signatures_match_the_cpu_tests():
    """deep_ep.Buffer's methods that the transport and factory call have the names, order and
    defaults the CPU tests bind the calls to."""
    import deep_ep

    version = getattr(deep_ep, "__version__", "?")
    for name in ("__init__", "get_dispatch_config", "get_combine_config", "get_low_latency_rdma_size_hint",
                 *TRANSPORT_METHODS):
        member = inspect.getattr_static(deep_ep.Buffer, name)
        sig = inspect.signature(getattr(deep_ep.Buffer, name))
        if not isinstance(member, staticmethod):
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        found = [(p.name, p.default) for p in sig.parameters.values()]
        assert found == [(p.name, p.default) for p in signature(name).parameters.values()], \
            f"deep_ep {version}: Buffer.{name}{sig} differs from the CPU tests' Buffer.{name}{signature(name)}"
