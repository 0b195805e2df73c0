"""CUDA-graph capture of decode (issue 17), tested on CPU against a fake capture.

:class:`FakeGraphCapturer` replays a "graph" by running the captured function again over
the same static batch, and fails if the attention metadata or the batch's tensors are not
the very tensors captured: the runner's bucketing, padding and static-buffer copies are
the code a GPU runs, so a runner that forgot to copy an input, padded wrongly or let a
backend re-allocate its metadata gives wrong tokens or an error here.

The decode attention under test is :class:`GraphSafeDecode`: torch_native, except that
decode is a dense masked gather over a fixed width with its mask rewritten in place, the
shape of decode a real graph can hold.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from engine_checks import leak_checked_engine
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.cuda_graph import (
    CudaGraphRunner,
    FakeGraphCapturer,
    capture_sizes,
    graph_off_reason,
)
from radixserve.engine.memory import kv_pool_budget
from radixserve.layers.attention import ForwardMode
from radixserve_attention_torch import TorchNativeAttention
from tiny_models import build_checkpoint, random_prompts

CONTEXT = 96


class GraphSafeDecode(TorchNativeAttention):
    """Decode as tensor ops only over ``[B, max_context_len]`` (no CPU lists), its validity
    mask a fixed buffer rewritten in place: capturable. Extend is torch_native's."""

    supports_cuda_graph = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx, use_kernels=False)
        self.cols = torch.arange(ctx.max_context_len)
        self.valid = torch.zeros(0, ctx.max_context_len, dtype=torch.bool)

    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        self.valid = torch.zeros(max_batch_size, self.ctx.max_context_len, dtype=torch.bool)

    def init_forward_metadata(self, batch) -> None:
        if not batch.is_decode:
            return super().init_forward_metadata(batch)
        if batch.batch_size > self.valid.shape[0]:
            self.init_cuda_graph_state(batch.batch_size)
        valid = self.valid[:batch.batch_size]
        torch.lt(self.cols[None, :], batch.seq_lens[:, None], out=valid)
        batch.attn_metadata = valid

    init_forward_metadata_capture_cuda_graph = init_forward_metadata
    init_forward_metadata_replay_cuda_graph = init_forward_metadata

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        width = self.ctx.max_context_len
        slots = batch.req_to_token[batch.req_pool_indices, :width]  # [B, L]
        keys = pool.k_buffers[layer.layer_id][slots].to(q.dtype)  # [B, L, Hkv, D]
        values = pool.v_buffers[layer.layer_id][slots].to(q.dtype)
        group = layer.num_heads // layer.num_kv_heads
        keys = keys.repeat_interleave(group, dim=2)  # [B, L, H, D]
        values = values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,blhd->bhl", q.view(q.shape[0], layer.num_heads, -1), keys) * layer.scaling
        scores = scores.masked_fill(~batch.attn_metadata[:, None, :], float("-inf"))
        out = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)
        return out.reshape(q.shape)


class PlainTorchNative(TorchNativeAttention):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, use_kernels=False)


class Reallocating(GraphSafeDecode):
    """Breaks the protocol: a fresh metadata tensor at every replay."""

    def init_forward_metadata_replay_cuda_graph(self, batch) -> None:
        batch.attn_metadata = torch.lt(self.cols[None, :], batch.seq_lens[:, None])


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("graph_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


def _use(engine, cls):
    if engine.runner.graph_runner is not None:  # the CPU's kernel tapes recorded the old backend's kernels
        engine.runner.graph_runner.close()
        engine.runner.graph_runner = None
    backend = cls(engine.runner.attn_backend.ctx)
    engine.runner.attn_backend = backend
    engine.runner.model.set_attention_backend(backend)
    return backend


# ----------------------------------------------------------------- unit logic
def test_capture_sizes_ladder_and_explicit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(160)[-3:] == [144, 152, 160]
    assert capture_sizes(16, [8, 3, 3, 64]) == [3, 8]  # sorted, unique, none above the max
    assert capture_sizes(2, [4, 8]) == [4]  # nothing fits: the smallest given


def test_flags_parse_and_validate():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--cuda-graph-bs", "1", "2", "8", "--cuda-graph-max-bs", "8", "--disable-cuda-graph",
                            "--disable-cuda-graph-padding"])
    args = ServerArgs.from_cli_args(ns)
    assert args.cuda_graph_bs == [1, 2, 8] and args.cuda_graph_max_bs == 8
    assert args.disable_cuda_graph and args.disable_cuda_graph_padding
    for bad in ([], [0], ["4"], [True]):
        with pytest.raises(ConfigError, match="--cuda-graph-bs"):
            ServerArgs(cuda_graph_bs=bad)
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0)


def test_kv_pool_budget_follows_mem_fraction_static():
    gib = 2**30
    # GPU: free memory after loading, less what the fraction leaves for activations
    reserve = int(0.12 * 100 * gib)
    assert kv_pool_budget(0.88, device_type="cuda", total=100 * gib, free=80 * gib) == 80 * gib - reserve
    # another process holding memory shows up in `free`, not in an assumption
    assert kv_pool_budget(0.88, device_type="cuda", total=100 * gib, free=50 * gib) == 50 * gib - reserve
    with pytest.raises(ValueError, match="--mem-fraction-static 0.5: no memory left"):
        kv_pool_budget(0.5, device_type="cuda", total=100 * gib, free=40 * gib)
    # CPU: the fraction of what is available after the weights
    assert kv_pool_budget(0.25, device_type="cpu", total=100 * gib, free=20 * gib) == 5 * gib


def test_bucket_mapping_padding_and_buffer_reuse(tiny_path):
    """Each batch size replays in the smallest captured size holding it; the static batch of a
    bucket is one object whose tensors never change; padding rows point at scratch slot 0
    through the reserved all-zero table row; without padding only exact sizes replay."""
    with leak_checked_engine(tiny_path, max_running_requests=8, context_length=CONTEXT,
                             cuda_graph_bs=[1, 2, 4, 8]) as engine:
        runner = engine.runner
        _use(engine, GraphSafeDecode)
        fake = FakeGraphCapturer()
        runner.init_cuda_graphs(fake)
        g = runner.graph_runner
        assert g.sizes == [1, 2, 4, 8] and len(fake.graphs) == 4
        assert [g.bucket_for(b) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
        table = runner.req_to_token_pool
        assert table.num_reserved == 1 and int(table.req_to_token[g.pad_row].abs().sum()) == 0
        static = {bs: (g.batches[bs], g.batches[bs].input_ids.data_ptr()) for bs in g.sizes}

        outs = engine.generate(input_ids=random_prompts(5, 9, seed=1),
                               sampling_params=[{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
                                                for n in (3, 5, 7, 9, 11)])
        assert [len(o["output_ids"]) for o in outs] == [3, 5, 7, 9, 11]
        stats = engine.get_stats()
        # 5 -> bucket 8, 4 -> 4, 3 -> 4, 2 -> 2, 1 -> 1: every bucket replayed, padding used
        assert set(stats["cuda_graph_replays_by_bs"]) == {1, 2, 4, 8}
        assert stats["cuda_graph_replays"] == sum(g.replays.values()) == sum(f.replays for f in fake.graphs)
        assert {bs: (g.batches[bs], g.batches[bs].input_ids.data_ptr()) for bs in g.sizes} == static
        # bucket 4's last replay had 3 real rows after one with 4: its row 3 was re-padded (the
        # smaller buckets replayed since only wrote rows 0-1)
        assert int(g.req_pool_indices[3]) == g.pad_row and int(g.out_cache_loc[3]) == 0
        assert int(g.seq_lens[3]) == 1 and int(g.positions[3]) == 0 and int(g.input_ids[3]) == 0
        assert int(g.seq_lens[2]) > 1  # a real row
        assert int(table.req_to_token[g.pad_row].abs().sum()) == 0  # padding never wrote the table

        g.pad = False  # --disable-cuda-graph-padding
        assert [g.bucket_for(b) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, None, 4, None, 8]


def test_same_tokens_and_logits_as_eager(tiny_path):
    """Greedy tokens with graphs (several requests finishing at different steps, so the
    batch shrinks across buckets) equal the eager decode's, and one decode batch's logits
    equal eager logits."""
    prompts = random_prompts(6, 13, seed=4)
    params = [{"temperature": 0.0, "max_new_tokens": 4 + 3 * i, "ignore_eos": True} for i in range(6)]
    results = {}
    for mode in ("eager", "graph"):
        with leak_checked_engine(tiny_path, max_running_requests=8, context_length=CONTEXT) as engine:
            _use(engine, GraphSafeDecode)
            if mode == "graph":
                engine.runner.init_cuda_graphs(FakeGraphCapturer())
                assert engine.runner.graph_runner.sizes == [1, 2, 4, 8]
            results[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            replays = engine.get_stats().get("cuda_graph_replays", 0)
            assert (replays > 0) == (mode == "graph")
    assert results["graph"] == results["eager"]


def test_replayed_logits_match_eager_forward(tiny_path):
    with leak_checked_engine(tiny_path, max_running_requests=8, context_length=CONTEXT) as engine:
        runner = engine.runner
        _use(engine, GraphSafeDecode)
        prompts = random_prompts(3, 11, seed=9)
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
        # a decode batch over three requests whose prompts are cached: build it by hand
        from radixserve.engine.request import Req
        from radixserve.sampling import SamplingParams

        reqs = []
        for i, p in enumerate(prompts):
            r = Req(f"r{i}", list(p), SamplingParams(max_new_tokens=4), 0)
            r.req_pool_idx = runner.req_to_token_pool.alloc()
            r.pages = runner.kv_pool.allocator.allocate(len(p) + 1)
            reqs.append(r)
        try:
            prefill = runner.build_batch(reqs, ForwardMode.EXTEND, [len(p) - 1 for p in prompts])
            runner.forward(prefill)
            for r, p in zip(reqs, prompts):
                r.kv_len = len(p) - 1
            eager = runner.forward(runner.build_batch(reqs, ForwardMode.DECODE))
            runner.init_cuda_graphs(FakeGraphCapturer())
            batch = runner.build_batch(reqs, ForwardMode.DECODE)
            assert runner.graph_runner.can_run(batch)
            graphed = runner.forward(batch)
            assert runner.graph_runner.replays[4] == 1
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
        finally:
            runner.graph_runner.close()
            runner.graph_runner = None
            for r in reqs:
                runner.kv_pool.allocator.free(r.pages)
                runner.req_to_token_pool.free(r.req_pool_idx)


@pytest.mark.parametrize("padding", [True, False])
def test_padding_flag_decides_whether_a_batch_of_3_replays(tiny_path, padding):
    """Captured sizes 1, 2, 4 and three requests decoding together: padded to 4 by default,
    run eagerly with --disable-cuda-graph-padding."""
    with leak_checked_engine(tiny_path, max_running_requests=8, context_length=CONTEXT, cuda_graph_bs=[1, 2, 4],
                             disable_cuda_graph_padding=not padding) as engine:
        _use(engine, GraphSafeDecode)
        engine.runner.init_cuda_graphs(FakeGraphCapturer())
        g = engine.runner.graph_runner
        assert g.pad == padding
        outs = engine.generate(input_ids=random_prompts(3, 5, seed=3),
                               sampling_params={"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
        assert all(len(o["output_ids"]) == 4 for o in outs)
        assert dict(g.replays) == ({4: 3} if padding else {})  # 3 decode steps after the prefill


def test_max_bs_flag_caps_the_captured_sizes(tiny_path):
    """--cuda-graph-max-bs cuts the ladder; without it the default (160) is capped by
    --max-running-requests."""
    for kw, sizes in (({"cuda_graph_max_bs": 3}, [1, 2, 3]), ({}, [1, 2, 4, 5])):
        with leak_checked_engine(tiny_path, max_running_requests=5, context_length=CONTEXT, **kw) as engine:
            _use(engine, GraphSafeDecode)
            engine.runner.init_cuda_graphs(FakeGraphCapturer())
            assert engine.runner.graph_runner.sizes == sizes


def test_fake_capture_catches_reallocated_metadata(tiny_path):
    """A backend that allocates new metadata at replay would make a real graph read stale
    buffers: the fake capture refuses it, and the failure ends only that step's requests."""
    with leak_checked_engine(tiny_path, max_running_requests=4, context_length=CONTEXT,
                             cuda_graph_bs=[4]) as engine:
        _use(engine, Reallocating)
        engine.runner.init_cuda_graphs(FakeGraphCapturer())
        out = engine.generate(input_ids=random_prompts(1, 7, seed=2)[0],
                              sampling_params={"temperature": 0.0, "max_new_tokens": 3})
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "attention metadata moved" in out["meta_info"]["finish_reason"]["message"]


def test_eager_reasons(tiny_path):
    """Where decode stays eager on CUDA, and why (logged at start-up)."""
    with leak_checked_engine(tiny_path, context_length=CONTEXT) as engine:
        runner = engine.runner
        assert runner.graph_runner is not None  # CPU: decode kernel tapes of torch_native's kernels
        _use(engine, PlainTorchNative)  # its PyTorch path only: nothing a tape or graph can hold
        reason = graph_off_reason(runner, runner.args)
        assert "does not support decode graphs" in reason and "torch_native" in reason
        _use(engine, GraphSafeDecode)
        assert graph_off_reason(runner, runner.args) is None
        runner.args.disable_cuda_graph = True
        assert graph_off_reason(runner, runner.args) == "--disable-cuda-graph"
        runner.args.disable_cuda_graph = False
        # extend batches, oversized batches and batches keeping hidden states never replay
        runner.init_cuda_graphs(FakeGraphCapturer())
        g: CudaGraphRunner = runner.graph_runner
        b = g.batches[1]
        b_ext = type(b)(**{**b.__dict__, "mode": ForwardMode.EXTEND})
        assert not g.can_run(b_ext)
        b_hidden = type(b)(**{**b.__dict__, "capture_hidden_layers": (0,)})
        assert not g.can_run(b_hidden)
        b_big = type(b)(**{**b.__dict__, "batch_size": g.max_bs + 1})
        assert not g.can_run(b_big)
        g.close()
        runner.graph_runner = None
