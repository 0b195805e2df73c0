"""The flashinfer backend on CPU: its availability probe and factory here, and the backend
driven end to end through a stand-in of FlashInfer's wrapper classes
(``flashinfer_standin``, FlashInfer's documented semantics in torch): the shared
conformance suite, the CUDA-graph protocol's buffers, and layers with their own window."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from flashinfer_standin import LOG, module
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardMode
from radixserve.registry import BackendUnavailableError, Registry
from radixserve.testing.attention_conformance import CASES, KV_DTYPE_CASES, MLA_CASES, run_case
from radixserve_attention_flashinfer import make_backend, unavailable_reason
from radixserve_attention_flashinfer.backend import FlashInferAttention

HAVE_GPU_AND_LIB = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def standin(ctx):
    return FlashInferAttention(ctx, lib=module(), workspace_bytes=16)


# ------------------------------------------------------------ probe and factory
@pytest.mark.skipif(HAVE_GPU_AND_LIB, reason="flashinfer can run here")
def test_probe_says_why_not():
    reason = unavailable_reason()
    assert reason
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer is not installed (pip install flashinfer-python)" in reason
    if not torch.cuda.is_available():
        assert "GPU" in reason


@pytest.mark.skipif(HAVE_GPU_AND_LIB, reason="flashinfer can run here")
def test_registry_lists_it_unavailable_and_refuses_it(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radixserve-attention-flashinfer")
    registry = Registry()
    registry.load_entry_points()
    entry = registry.get("attention", "flashinfer")
    assert entry.distribution == "radixserve-attention-flashinfer"
    assert entry.unavailable_reason() == unavailable_reason()
    with pytest.raises(BackendUnavailableError, match="--attention-backend: .*'flashinfer'.*not available"):
        registry.resolve("attention", "flashinfer", flag="--attention-backend")


def test_factory_refuses_cpu_and_float32_before_importing_flashinfer():
    ctx = AttentionContext(num_heads=4, num_kv_heads=2, head_dim=64, num_layers=1, dtype=torch.bfloat16,
                           device=torch.device("cpu"), page_size=16, max_context_len=64, max_batch_size=2)
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs.*--attention-backend torch_native"):
        make_backend(ctx)
    with pytest.raises(ValueError, match="num_heads .5. must be a multiple"):
        make_backend(AttentionContext(num_heads=5, num_kv_heads=2, head_dim=64, num_layers=1,
                                      dtype=torch.bfloat16, device=torch.device("cpu"), page_size=16,
                                      max_context_len=64, max_batch_size=2))


# ------------------------------------------------------------ through the stand-in
# the suite less its head-dim-128 repeats of the extend/decode shapes: what is checked here
# is the mapping onto FlashInfer's arguments, which the head dim does not change (the GPU
# tests run the kernels at 64, 128 and 256)
STANDIN_CASES = [c for c in CASES if not (c.head_dim == 128 and c.mode in ("extend", "decode"))]


@pytest.mark.parametrize("case", STANDIN_CASES, ids=str)
def test_conforms_through_the_standin(case):
    run_case(standin, case)


@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=str)
def test_kv_dtypes_through_the_standin(case):
    if case.kv_dtype not in FlashInferAttention.supported_kv_dtypes:
        pytest.skip(f"FlashInfer's fa2 kernels widen fp8 KV only: {case.kv_dtype} with float32 queries is refused")
    run_case(standin, case)


@pytest.mark.parametrize("case", [c for c in MLA_CASES if c.mode != "verify" and c.kv_dtype is None], ids=str)
def test_mla_through_the_standin(case):
    """MLA: the MLA wrapper over two strided views of the latent pool, the ragged wrapper for
    the expanded prefill."""
    run_case(standin, case)


def test_mla_refuses_verify_and_narrows_what_it_declares():
    ctx = AttentionContext(num_heads=16, num_kv_heads=1, head_dim=40, num_layers=1, dtype=torch.float32,
                           device=torch.device("cpu"), page_size=16, max_context_len=64, max_batch_size=2,
                           v_head_dim=32)
    backend = standin(ctx)
    assert backend.supports_mla and not backend.supports_target_verify and not backend.supports_cuda_graph
    (case,) = [c for c in MLA_CASES if c.mode == "verify" and c.page_size == 16]
    with pytest.raises(ValueError, match="supports_target_verify"):
        run_case(standin, case)


def test_cuda_graph_replay_rewrites_the_captured_buffers_in_place():
    """Capture a bucket of 4 with 3 real requests (the 4th a padding row) through the
    core's FakeGraphCapturer, which fails a replay whose metadata tensors moved; every row
    one token long at capture, as the engine captures. Replays at other lengths read the
    same buffers, rewritten, and give what the reference gives."""
    from flashinfer_batches import decode_step
    from radixserve.engine.cuda_graph import FakeGraphCapturer

    step = decode_step([1, 1, 1], bucket=4)
    backend = standin(step.ctx)
    backend.init_cuda_graph_state(8)
    batch = step.batch
    backend.init_forward_metadata_capture_cuda_graph(batch)
    plan = batch.attn_metadata
    (wrapper,) = plan.wrappers.values()
    assert wrapper.use_cuda_graph and len(wrapper.bufs[0]) == 5  # indptr of the bucket of 4
    graph = FakeGraphCapturer().capture(
        lambda: backend.forward(step.q, step.k, step.v, step.layer, batch), batch)
    for lens, indptr in (([40, 3, 77], [0, 3, 4, 9, 10]), ([9, 120, 17], [0, 1, 9, 11, 12])):
        step.set_lengths(lens)
        backend.init_forward_metadata_replay_cuda_graph(batch)
        assert batch.attn_metadata is plan and list(plan.wrappers.values()) == [wrapper]
        graph.replay()
        torch.testing.assert_close(graph.output[:3], step.eager(), rtol=1e-5, atol=1e-5)
        assert wrapper.bufs[0].tolist() == indptr  # pages of 16 tokens; the padding row: page 0
        assert torch.isfinite(graph.output).all()


def test_cuda_graph_state_is_needed_before_capture():
    from flashinfer_batches import decode_step

    step = decode_step([5, 6], bucket=2)
    backend = standin(step.ctx)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(step.batch)
    backend.init_cuda_graph_state(2)
    step.batch.mode = ForwardMode.EXTEND
    with pytest.raises(ValueError, match="decode steps only"):
        backend.init_forward_metadata_capture_cuda_graph(step.batch)


def test_a_layer_with_its_own_window_is_planned_once_then_every_step():
    """The default (no window, 1/sqrt(D)) is planned with the step's metadata; a layer with
    a sliding window plans its wrapper on first use, and from the next step on up front."""
    from flashinfer_batches import decode_step

    step = decode_step([40, 3, 77], bucket=3)
    backend = standin(step.ctx)
    windowed = AttentionLayer(0, step.layer.num_heads, step.layer.num_kv_heads, step.layer.head_dim,
                              step.layer.scaling, sliding_window=8)
    for n in range(2):
        LOG.clear()
        backend.init_forward_metadata(step.batch)
        planned_up_front = len(LOG)
        backend.forward(step.q, step.k, step.v, step.layer, step.batch)
        out = backend.forward(step.q, step.k, step.v, windowed, step.batch)
        assert planned_up_front == (1 if n == 0 else 2)
        assert len(LOG) == 2 and [c[2]["window_left"] for c in LOG] == [-1, 7]
        torch.testing.assert_close(out, step.eager(windowed), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
def test_calls_bind_to_flashinfers_own_signatures():
    """Where flashinfer is installed (it imports without a GPU): every constructor, plan
    and run call the backend makes through the stand-in binds to the real method's signature."""
    import inspect
    import types

    import flashinfer
    import flashinfer_standin

    calls = []

    def recording(standin_cls, real_cls):
        class Recording(standin_cls):
            def __init__(self, *a, **k):
                calls.append((real_cls.__init__, a, k))
                super().__init__(*a, **k)

            def plan(self, *a, **k):
                calls.append((real_cls.plan, a, k))
                return super().plan(*a, **k)

            def run(self, *a, **k):
                calls.append((real_cls.run, a, k))
                return super().run(*a, **k)

        return Recording

    import flashinfer.mla

    names = ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
             "BatchPrefillWithRaggedKVCacheWrapper")
    lib = types.SimpleNamespace(**{n: recording(getattr(flashinfer_standin, n), getattr(flashinfer, n))
                                   for n in names})
    lib.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=recording(
        flashinfer_standin.BatchMLAPagedAttentionWrapper, flashinfer.mla.BatchMLAPagedAttentionWrapper))

    def factory(ctx):
        return FlashInferAttention(ctx, lib=lib, workspace_bytes=16)

    for case in CASES:
        if case.page_size == 16 and (case.mode != "extend" or case.sliding_window):
            run_case(factory, case)
    for case in MLA_CASES:  # the MLA wrapper (absorbed steps) and the ragged one (expanded prefill)
        if case.page_size == 16 and case.mode != "verify" and case.kv_dtype is None:
            run_case(factory, case)
    from flashinfer_batches import decode_step

    step = decode_step([3, 40], bucket=4)
    backend = factory(step.ctx)
    backend.init_cuda_graph_state(4)
    backend.init_forward_metadata_capture_cuda_graph(step.batch)
    backend.forward(step.q, step.k, step.v, step.layer, step.batch)
    kinds = {(fn.__qualname__, bool(k.get("use_cuda_graph") or k.get("custom_mask") is not None))
             for fn, _, k in calls}
    assert len(kinds) >= 7  # plain and graph/mask variants of the constructors and plans, both runs
    assert {fn.__qualname__.split(".")[0] for fn, _, _ in calls} == set(names) | {"BatchMLAPagedAttentionWrapper"}
    for fn, args, kwargs in calls:
        inspect.signature(fn).bind(None, *args, **kwargs)  # TypeError on a name or arity flashinfer lacks
