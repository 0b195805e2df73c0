"""The deepep transport with DeepEP's real kernels: at least 2 NVLink-connected sm90 GPUs
and deep_ep installed (skipped otherwise, with the reason). DeepEP's normal (intranode)
kernels take 2, 4 or 8 ranks (``SWITCH_RANKS`` in csrc/kernels/legacy/launch.cuh, and
``Buffer.get_dispatch_config`` has no entry for 1), so one GPU cannot run them.

Each mode runs the a2a conformance suite on bf16 cases with a hidden size DeepEP's
low-latency kernels take, one rank per GPU over NCCL: ``combine(runner(dispatch(x)))``
against the single-rank reference over all experts (bf16 tolerance, 3e-2), the same
check the torch_distributed transport passes; then ``TIMING`` lines of dispatch + combine
against torch_distributed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from radixserve.testing.moe_conformance import A2ACase, run_a2a_cases_on_ranks
from radixserve_a2a_deepep import DeepEPOptions, make_transport, unavailable_reason

REASON = unavailable_reason()
if REASON is None and torch.cuda.device_count() < 2:
    REASON = (f"{torch.cuda.device_count()} GPU(s); DeepEP's intranode kernels need 2, 4 or 8 ranks, one GPU "
              "each")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"deepep: {REASON}")]

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


@pytest.mark.parametrize("factory", [make_normal, make_low_latency, make_auto], ids=lambda f: f.__name__)
def test_conformance_on_gpus(factory):
    run_a2a_cases_on_ranks(factory, _world(), CASES, device="cuda",
                           timeout_s=300)


def _timing_rank(rank, world_size, init_method, num_tokens):
    import time

    import torch.distributed as dist
    from radixserve.layers.moe import MoEContext, select_experts
    from radixserve_moe_a2a_torch import TorchDistributedA2A

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size)
    ctx = MoEContext(num_experts=64, top_k=8, hidden_size=4096, intermediate_size=256, dtype=torch.bfloat16,
                     device=torch.device("cuda", rank), ep_rank=rank, ep_size=world_size)
    x = torch.randn(num_tokens, 4096, device="cuda").to(torch.bfloat16)
    ids, w = select_experts(torch.randn(num_tokens, 64, device="cuda"), 8, True)
    lines = []
    for name, a2a in (("deepep", make_auto(ctx)), ("torch_distributed", TorchDistributedA2A(ctx))):
        def step():
            d = a2a.dispatch(x, ids, w)  # noqa: B023
            return a2a.combine(d.hidden_states, d)  # noqa: B023
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        lines.append(f"TIMING a2a T={num_tokens} P={world_size} {name} {(time.perf_counter() - t0) * 100:.3f} ms")
    return lines


@pytest.mark.parametrize("num_tokens", [64, 4096])
def test_timings_against_torch_distributed(num_tokens):
    from radixserve.testing.multi_rank import run_ranks

    for line in run_ranks(_timing_rank, _world(), num_tokens, timeout_s=300)[0]:
        print(line)
