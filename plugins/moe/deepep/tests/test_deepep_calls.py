"""CPU tests of what the deepep transport and its factory call on ``deep_ep``: DeepEP 2.1.0's
``Buffer`` signatures (deep_ep_signatures.py) against the fake buffer and against the
calls, the factory over a stand-in ``deep_ep`` module, the top-k limits, and the probe's
API check. No DeepEP code runs here.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from deep_ep_signatures import TRANSPORT_METHODS, BindingBuffer, BufferSignatures, Group, fake_deep_ep, signature
from radixserve.layers.moe import MoEContext
from radixserve_a2a_deepep import LOW_LATENCY_MAX_TOPK, DeepEPOptions, api, make_transport, unavailable_reason
from radixserve_a2a_deepep.fake import DeepEPRefusal, FakeDeepEPBuffer


def _ctx(mode: str = "auto", **kw) -> MoEContext:
    base = dict(num_experts=16, top_k=8, hidden_size=4096, intermediate_size=256, dtype=torch.bfloat16,
                device=torch.device("cpu"), ep_rank=0, ep_size=2, ep_group=Group(0, 2),
                options=DeepEPOptions(deepep_mode=mode))
    base.update(kw)
    return MoEContext(**base)


@pytest.fixture
def deep_ep(monkeypatch):
    """A stand-in ``deep_ep`` in ``sys.modules`` and a GPU the probe's device checks accept."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    module = fake_deep_ep()
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    return module


def _plain(sig: inspect.Signature) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", TRANSPORT_METHODS)
def test_fake_buffer_has_deepeps_signatures(name):
    fake = inspect.signature(getattr(FakeDeepEPBuffer(0, 1), name))
    assert _plain(fake) == _plain(signature(name))


def test_call_table_binds_to_deepeps_signatures():
    """Each call the probe checks (api.BUFFER_CALLS) is one DeepEP's Buffer takes."""
    for call in api.BUFFER_CALLS:
        signature(call.name).bind(*([None] * call.num_positional), **dict.fromkeys(call.keywords))
    assert {c.name for c in api.BUFFER_CALLS} >= set(TRANSPORT_METHODS)


def _ll_inputs(k=2, n=4, hidden=2048):
    x = torch.zeros(n, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(8)[:k] for _ in range(n)])  # int64, DeepEP's topk_idx_t
    return x, ids


def test_changed_calls_fail():
    """What a changed call site runs into: a renamed or unknown keyword (DeepEP's signature),
    a swapped order or another dtype (DeepEP's host checks in the fake)."""
    buffer = BindingBuffer(0, 1)
    x, ids = _ll_inputs()
    recv = buffer.low_latency_dispatch(x, ids, 16, 8, use_fp8=False, return_recv_hook=True)  # as the transport calls
    assert recv[0].shape == (8, 16, 2048)
    with pytest.raises(TypeError):  # a keyword DeepEP does not have
        buffer.low_latency_dispatch(x, topk_ids=ids, num_max_dispatch_tokens_per_rank=16, num_experts=8, use_fp8=False)
    with pytest.raises(DeepEPRefusal, match="x must be torch.bfloat16"):  # x and topk_idx swapped
        buffer.low_latency_dispatch(ids, x, 16, 8, use_fp8=False)
    with pytest.raises(DeepEPRefusal, match="topk_idx must be torch.int64"):  # ids left as int32
        buffer.low_latency_dispatch(x, ids.int(), 16, 8, use_fp8=False)
    with pytest.raises(DeepEPRefusal, match="exceed num_max_dispatch_tokens_per_rank"):  # cap and experts swapped
        buffer.low_latency_dispatch(x, ids, 2, 16, use_fp8=False)
    with pytest.raises(DeepEPRefusal, match=f"top-k <= {LOW_LATENCY_MAX_TOPK}, not 12"):
        buffer.low_latency_dispatch(x, torch.zeros(4, 12, dtype=torch.int64), 16, 8, use_fp8=False)
    layout = buffer.get_dispatch_layout(ids, 8)
    with pytest.raises(DeepEPRefusal, match="topk_weights must be torch.float32"):
        buffer.dispatch(x, topk_idx=ids, topk_weights=torch.ones(4, 2, dtype=torch.float64),
                        num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    with pytest.raises(DeepEPRefusal, match="is_token_in_rank must be 2-D"):  # two layout tensors swapped
        buffer.dispatch(x, topk_idx=ids, topk_weights=torch.ones(4, 2), num_tokens_per_rank=layout[3],
                        is_token_in_rank=layout[0], num_tokens_per_expert=layout[2])
    assert [b.name for b in buffer.bound][:1] == ["low_latency_dispatch"]


def test_normal_only_buffer_refuses_low_latency_calls():
    with pytest.raises(DeepEPRefusal, match="low_latency_mode=True"):
        FakeDeepEPBuffer(0, 1, low_latency_mode=False).low_latency_dispatch(*_ll_inputs(), 16, 8, use_fp8=False)


@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_factory_builds_the_buffer_as_deepep_declares_it(deep_ep, mode):
    a2a = make_transport(_ctx(mode))
    assert a2a.mode == mode and a2a.topk_idx_dtype == torch.int64
    table = {c.name: c for c in api.BUFFER_CALLS}
    for call in deep_ep.calls:  # bound to DeepEP's signatures when made; now the call table
        assert (call.num_positional, call.keywords) == (table[call.name].num_positional, table[call.name].keywords)
    names = [c.name for c in deep_ep.calls]
    expected = (["get_dispatch_config", "get_combine_config"] if mode != "low_latency" else []) + \
        (["get_low_latency_rdma_size_hint"] if mode != "normal" else []) + ["__init__"]
    assert names == expected
    init = deep_ep.calls[-1].arguments
    low_latency = mode != "normal"
    assert init["low_latency_mode"] is low_latency and init["num_qps_per_rank"] == (8 if low_latency else 1)
    assert init["num_nvl_bytes"] == (0 if mode == "low_latency" else 1000 * 4096 * 2 * 2)
    assert init["num_rdma_bytes"] == (3000 * 4096 if low_latency else 0)
    if low_latency:
        assert deep_ep.calls[-2].arguments == {"num_max_dispatch_tokens_per_rank": 128, "hidden": 4096,
                                               "num_ranks": 2, "num_experts": 16}
    assert deep_ep.buffers == [a2a.buffer]


def test_low_latency_refuses_top_k_over_11(deep_ep):
    with pytest.raises(ValueError, match=r"--deepep-mode low_latency: DeepEP's low-latency kernels take top-k <= 11 "
                                         r".*routes each token to 12 experts \(top-k 12\)"):
        make_transport(_ctx("low_latency", top_k=12))
    assert deep_ep.calls == []  # refused before DeepEP is touched
    assert make_transport(_ctx("low_latency", top_k=11)).mode == "low_latency"
    auto = make_transport(_ctx("auto", top_k=12))  # auto: normal kernels only
    assert auto.mode == "normal" and deep_ep.calls[-1].arguments["low_latency_mode"] is False
    with pytest.raises(ValueError, match="at most 32 experts per token; this model's top-k is 33"):
        make_transport(_ctx("normal", top_k=33, num_experts=64))


def test_probe_accepts_deepeps_api(deep_ep):
    assert unavailable_reason() is None
    real = types.SimpleNamespace(Buffer=BufferSignatures, Config=deep_ep.Config, topk_idx_t=torch.int64)
    assert api.api_mismatch(real) is None


def test_probe_names_what_an_older_deep_ep_lacks(monkeypatch, deep_ep):
    class OldBuffer:  # no low-latency kernels, and a dispatch without keywords for the layout
        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0): ...

        @staticmethod
        def get_dispatch_config(num_ranks): ...

        @staticmethod
        def get_combine_config(num_ranks): ...

        def get_dispatch_layout(self, topk_idx, num_experts): ...

        def dispatch(self, x, topk_idx, topk_weights, async_finish=False): ...

        def combine(self, x, handle, async_finish=False): ...

    old = types.SimpleNamespace(Buffer=OldBuffer, Config=deep_ep.Config, __spec__=deep_ep.__spec__)
    monkeypatch.setitem(sys.modules, "deep_ep", old)
    reason = unavailable_reason()
    assert reason.startswith("the installed deep_ep (no __version__) lacks topk_idx_t, Buffer.get_low_latency_rdma")
    for name in ("Buffer.clean_low_latency_buffer", "Buffer.low_latency_dispatch", "Buffer.low_latency_combine",
                 "Buffer.__init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0)", "Buffer.dispatch(", api.NEEDED):
        assert name in reason
    with pytest.raises(RuntimeError, match="deepep is unavailable: the installed deep_ep"):
        make_transport(_ctx("normal"))
