"""CPU tests of the deepep transport's own code: DeepEP's dispatch outputs -> the core's
dispatched layout, the mode choice, and the transport on two gloo ranks over
``FakeDeepEPBuffer`` (DeepEP's documented Buffer semantics and host checks in
torch.distributed), every call bound to DeepEP's real signatures (deep_ep_signatures.py).

These tests do NOT run DeepEP: no kernel, NVLink or RDMA path is exercised. The real
library is tested in test_deepep_gpu.py (several GPUs and deep_ep needed).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from deep_ep_signatures import TRANSPORT_METHODS, BindingBuffer
from radixserve.config import ConfigError, ServerArgs
from radixserve.layers.moe import MoEContext
from radixserve.registry import get_registry
from radixserve.testing.moe_conformance import A2A_CASES, A2ACase, run_a2a_case
from radixserve.testing.multi_rank import run_ranks
from radixserve_a2a_deepep import (
    DeepEPA2A,
    DeepEPOptions,
    api,
    make_transport,
    register_moe_a2a_backends,
    unavailable_reason,
)
from radixserve_a2a_deepep.convert import dispatch_to_masked, masked_to_dispatch, normal_to_dispatch
from radixserve_a2a_deepep.fake import FakeDeepEPBuffer


def _ctx(**kw) -> MoEContext:
    base = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, dtype=torch.bfloat16,
                device=torch.device("cpu"))
    base.update(kw)
    return MoEContext(**base)


def test_masked_to_dispatch_and_back():
    recv_x = torch.randn(3, 5, 16)  # [E_local, C, H]
    count = torch.tensor([2, 0, 5], dtype=torch.int32)
    d = masked_to_dispatch(recv_x, count, top_k=4, handle="h")
    assert d.hidden_states.shape == (15, 16) and d.topk_ids.shape == (15, 4) and d.topk_weights.shape == (15, 4)
    assert d.topk_ids.dtype == torch.int32 and d.topk_weights.dtype == torch.float32 and d.handle == "h"
    expected_first = torch.tensor([0, 0, -1, -1, -1] + [-1] * 5 + [2] * 5, dtype=torch.int32)
    assert torch.equal(d.topk_ids[:, 0], expected_first)
    assert (d.topk_ids[:, 1:] == -1).all()
    assert torch.equal(d.topk_weights[:, 0], (expected_first >= 0).float()) and (d.topk_weights[:, 1:] == 0).all()
    assert torch.equal(dispatch_to_masked(d.hidden_states, 3), recv_x)


def test_normal_to_dispatch_casts_ids_and_weights():
    d = normal_to_dispatch(torch.randn(4, 8), torch.tensor([[0, -1]] * 4), torch.rand(4, 2, dtype=torch.float64), 7)
    assert d.topk_ids.dtype == torch.int32 and d.topk_weights.dtype == torch.float32 and d.handle == 7


@pytest.mark.parametrize("mode,tokens,expected", [
    ("auto", 256, "low_latency"), ("auto", 257, "normal"), ("normal", 3, "normal"), ("low_latency", 900, "low_latency"),
])
def test_mode_choice(mode, tokens, expected):
    a2a = DeepEPA2A(_ctx(ep_size=2), FakeDeepEPBuffer(0, 2), mode=mode, num_max_dispatch_tokens_per_rank=128)
    assert a2a.resolve_mode(tokens) == expected  # auto: the largest share, ceil(T / 2), against the cap


def _fake_factory(mode: str, cap: int, buffers: list):
    def factory(ctx):
        buffer = BindingBuffer(ctx.ep_rank, ctx.ep_size, low_latency_mode=mode != "normal")
        buffers.append((buffer, ctx))
        return DeepEPA2A(ctx, buffer, mode=mode, num_max_dispatch_tokens_per_rank=cap)
    return factory


def _check_bound(call, ctx, cap: int) -> None:
    """One transport call as DeepEP reads it: the call table the probe checks (api.py), and
    the arguments' values and dtypes."""
    table = {c.name: c for c in api.BUFFER_CALLS}
    assert call.name in TRANSPORT_METHODS
    assert (call.num_positional, call.keywords) == (table[call.name].num_positional, table[call.name].keywords)
    a = call.arguments
    topk = a.get("topk_idx")
    if topk is not None:
        assert topk.dtype == torch.int64 and topk.is_contiguous() and topk.shape[1] == ctx.top_k
    if call.name == "get_dispatch_layout":
        assert a["num_experts"] == ctx.num_experts
    elif call.name == "dispatch":
        assert a["x"].dtype == torch.bfloat16 and a["x"].shape[1] == ctx.hidden_size
        assert a["topk_weights"].dtype == torch.float32 and a["async_finish"] is True
        assert a["num_tokens_per_rdma_rank"] is None and a["is_token_in_rank"].dtype == torch.bool
    elif call.name == "combine":
        assert a["x"].dtype == torch.bfloat16 and a["async_finish"] is True
    elif call.name == "clean_low_latency_buffer":
        assert a == {"num_max_dispatch_tokens_per_rank": cap, "hidden": ctx.hidden_size,
                     "num_experts": ctx.num_experts}
    elif call.name == "low_latency_dispatch":
        assert a["num_max_dispatch_tokens_per_rank"] == cap and a["num_experts"] == ctx.num_experts
        assert a["x"].dtype == torch.bfloat16 and a["x"].shape[0] <= cap
        assert (a["use_fp8"], a["async_finish"], a["return_recv_hook"]) == (False, False, True)
    else:  # low_latency_combine
        assert a["x"].shape == (ctx.num_local_experts, ctx.ep_size * cap, ctx.hidden_size)
        assert a["x"].dtype == torch.bfloat16 and a["topk_weights"].dtype == torch.float32
        assert (a["async_finish"], a["return_recv_hook"]) == (False, True)


def _rank_body(rank, world_size, init_method):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    # DeepEP moves bf16 rows, and its low-latency kernels take only some hidden sizes
    cases = [dataclasses.replace(c, dtype=torch.bfloat16) for c in A2A_CASES + [A2ACase(64, 8, 2, hidden_size=32)]]
    made, called = [], set()
    for mode in ("normal", "low_latency"):
        for i, case in enumerate(cases):
            if mode == "low_latency":
                case = dataclasses.replace(case, hidden_size=2048)
            run_a2a_case(_fake_factory(mode, 128, made), case, ep_rank=rank, ep_size=world_size, seed=i)
    # auto: a prefill-sized call (normal), then decode-sized ones (low-latency, buffer cleaned once)
    ctx = _ctx(ep_rank=rank, ep_size=world_size, hidden_size=2048)
    buffer = BindingBuffer(rank, world_size)
    made.append((buffer, ctx))
    a2a = DeepEPA2A(ctx, buffer, mode="auto", num_max_dispatch_tokens_per_rank=16)
    for t in (40, 8, 8):
        x = torch.randn(t, 2048).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8)[:2] for _ in range(t)]).int()
        d = a2a.dispatch(x, ids, torch.full((t, 2), 0.5, dtype=torch.bfloat16))  # bf16 router weights
        # a runner whose every expert returns ones: each token combines to the sum of its weights, 1
        row_weight = torch.where(d.topk_ids >= 0, d.topk_weights, torch.zeros_like(d.topk_weights)).sum(1, keepdim=True)
        out = a2a.combine(row_weight.expand(-1, 2048).to(torch.bfloat16), d)
        assert out.shape == (t, 2048) and torch.allclose(out.float(), torch.ones(t, 2048)), out
    for made_buffer, made_ctx in made:
        for call in made_buffer.bound:
            _check_bound(call, made_ctx, 16 if made_buffer is buffer else 128)
            called.add(call.name)
    return buffer.calls, called


def test_transport_on_two_ranks_with_fake_buffer():
    """The a2a conformance suite (every case in normal and in low_latency mode) and an auto
    run, on 2 gloo ranks with the fake buffer; every call on it bound to DeepEP's signatures."""
    results = run_ranks(_rank_body, 2, timeout_s=180)
    for rank_calls, called in results:
        # every call asynchronous, its result read only after the event or hook (the fake's NaN until then)
        assert rank_calls == ["get_dispatch_layout", "dispatch", "dispatch_event", "combine", "combine_event",
                              "clean_low_latency_buffer", "low_latency_dispatch", "dispatch_hook",
                              "low_latency_combine", "combine_hook",
                              "low_latency_dispatch", "dispatch_hook", "low_latency_combine", "combine_hook"]
        assert called == set(TRANSPORT_METHODS)


@pytest.mark.parametrize("case", [c for c in A2A_CASES if c.dtype == torch.bfloat16], ids=str)
def test_one_rank_is_the_identity_without_deep_ep(case):
    run_a2a_case(make_transport, case)  # ep_size 1: no Buffer is built, nothing imported


def test_unavailable_on_cpu_with_reason():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the probe's answer depends on the GPUs and deep_ep")
    assert "CUDA" in unavailable_reason()
    with pytest.raises(RuntimeError, match="deepep is unavailable: needs CUDA"):
        make_transport(_ctx(ep_size=2, hidden_size=4096))


def test_factory_rejects_what_deepep_cannot_move():
    with pytest.raises(ValueError, match="bfloat16"):
        make_transport(_ctx(dtype=torch.float32))
    with pytest.raises(ValueError, match="hidden sizes"):
        make_transport(_ctx(options=DeepEPOptions(deepep_mode="low_latency")))
    # hidden 64: no low-latency kernel
    assert make_transport(_ctx(options=DeepEPOptions(deepep_mode="auto"))).mode == "normal"


def test_registers_deepep_with_the_probe():
    seen = {}
    register_moe_a2a_backends(register=lambda name, factory, probe=None, description="", options=None:
                              seen.update({name: (probe, options)}))
    assert seen == {"deepep": (unavailable_reason, DeepEPOptions)}


def test_deepep_mode_flag():
    """--deepep-mode is the plugin's own flag: an Engine keyword and a CLI flag, checked."""
    assert DeepEPOptions().deepep_mode == "auto"
    assert ServerArgs.from_kwargs(deepep_mode="normal").plugin_options == {"deepep_mode": "normal"}
    with pytest.raises(ConfigError,
                       match="--deepep-mode: invalid value 'fast'; choose from: auto, normal, low_latency"):
        ServerArgs.from_kwargs(deepep_mode="fast")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--deepep-mode", "low_latency"]))
    entry = get_registry().get("moe_a2a", "deepep")
    assert args.options_for(entry) == DeepEPOptions(deepep_mode="low_latency")
    with pytest.raises(SystemExit):
        parser.parse_args(["--deepep-mode", "fast"])
