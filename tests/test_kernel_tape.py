"""Decode steps replayed as kernel tapes on CPU (issue 36, item 1; radixserve.kernels.tape).

A tape is the recorded sequence of a decode step's kernel calls, replayed from C. These
tests check that a replayed step gives the eager step's tokens for every linear storage the
CPU kernels have, that steps which must not replay run eagerly, that recording refuses a
forward with any computing torch op or a kernel without a tape twin, and that
``--disable-cuda-graph`` turns tapes off.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import radixserve
import torch
from engine_checks import wait_until_idle
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import tape
from tiny_models import build_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason=f"radixserve's CPU kernels are unavailable: {cpu_kernels.status()}")

CONTEXT = 160


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    paths = {}
    for variant in ("llama", "qwen2", "llama_tied", "qwen3"):
        paths[variant] = str(tmp_path_factory.mktemp(f"tape_{variant}"))
        build_checkpoint(paths[variant], variant, seed=11, max_position_embeddings=512)
    return paths


@contextlib.contextmanager
def _engine(path, **kw):
    kw.setdefault("dtype", "float32")
    engine = radixserve.Engine(path, enable_leak_check=True, max_total_tokens=4096, max_running_requests=8,
                               context_length=CONTEXT, **kw)
    try:
        yield engine
        wait_until_idle(engine)
    finally:
        engine.shutdown()


def _params(n):
    # requests finish at different steps: the batch shrinks through several buckets (padding too)
    return [{"temperature": 0.0, "max_new_tokens": 3 + 4 * i, "ignore_eos": True} for i in range(n)]


def _tokens_both_ways(path, prompts, params, **kw):
    got, stats = {}, {}
    for mode in ("tape", "eager"):
        with _engine(path, disable_cuda_graph=mode == "eager", **kw) as engine:
            got[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            stats[mode] = engine.get_stats()
            stats[mode]["has_runner"] = engine.runner.graph_runner is not None
    return got, stats


@pytest.mark.parametrize("variant,kw", [
    ("llama", {}),
    ("qwen2", {}),  # QKV bias
    ("llama_tied", {}),
    ("qwen3", {}),  # per-head q/k norms (a kernel of their own)
    ("llama", {"quantization": "w8a16_int8"}),
    ("llama", {"quantization": "int4wo"}),
    ("llama", {"dtype": "bfloat16"}),  # bf16 weights, float32 activations on CPU
])
def test_replayed_steps_give_the_eager_tokens(tiny_paths, variant, kw):
    got, stats = _tokens_both_ways(tiny_paths[variant], random_prompts(5, 11, seed=3), _params(5), **kw)
    assert got["tape"] == got["eager"]
    assert stats["tape"]["has_runner"] and stats["tape"]["cuda_graph_replays"] > 0
    assert len(stats["tape"]["cuda_graph_replays_by_bs"]) >= 3  # buckets recorded as batches needed them
    assert not stats["eager"]["has_runner"] and stats["eager"].get("cuda_graph_replays", 0) == 0


def test_default_model_tokens():
    """The default model (GGUF Q4_1 layers, Q8_0 head and embedding): greedy tokens with tapes
    equal eager ones."""
    prompts = random_prompts(4, 24, seed=8)
    from radixserve.model_loader import default_model_path

    got, stats = _tokens_both_ways(default_model_path(), prompts, _params(4))
    assert got["tape"] == got["eager"] and stats["tape"]["cuda_graph_replays"] > 0


def test_a_forward_with_native_ops_stays_eager(tiny_paths, caplog):
    """A bfloat16 KV cache takes the attention backend's PyTorch path (its kernel reads float32
    pools): the recording is refused at start-up (logged, naming the op) and every step runs
    eagerly."""
    with caplog.at_level("INFO", logger="radixserve.engine.graph_setup"):
        with _engine(tiny_paths["llama"], kv_cache_dtype="bfloat16") as engine:
            assert engine.runner.graph_runner is None
            engine.generate(input_ids=random_prompts(1, 5, seed=1)[0], sampling_params={"max_new_tokens": 2})
    assert any("kernel tapes off" in r.message and "torch op" in r.message for r in caplog.records)


def test_shared_prefix_steps_run_eagerly(tiny_paths):
    """Requests sharing a long cached prefix decode through the cascade path when eager; the
    tape's backend asks for those steps to run eagerly, so the tokens stay the eager ones."""
    prefix = random_prompts(1, 80, seed=5)[0]
    prompts = [prefix + p for p in random_prompts(3, 4, seed=6)]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    got = {}
    for mode in ("tape", "eager"):
        with _engine(tiny_paths["llama"], disable_cuda_graph=mode == "eager") as engine:
            engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})  # cache the prefix
            got[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            if mode == "tape":
                by_bs = engine.get_stats().get("cuda_graph_replays_by_bs", {})
                assert 3 not in by_bs and 4 not in by_bs  # the three-request steps ran eagerly
    assert got["tape"] == got["eager"]


def test_out_of_range_ids_fail_like_eager(tiny_paths):
    with _engine(tiny_paths["llama"]) as engine:
        graphs = engine.runner.graph_runner
        g = graphs.graphs[1]
        with torch.inference_mode():
            graphs.input_ids[0] = 10**6
            with pytest.raises(IndexError, match="out of range"):
                g.replay()
            graphs.input_ids.zero_()


def _count_decode_forwards(engine) -> list[int]:
    """Wrap the model so every decode-step forward it runs (eager, or being recorded) is counted."""
    model, calls = engine.runner.model, [0]
    inner = model.forward

    def counted(batch, *a, **k):
        calls[0] += batch.is_decode
        return inner(batch, *a, **k)
    model.forward = counted
    return calls


def test_a_new_batch_size_is_recorded_over_its_own_step(tiny_paths):
    """A batch size first needed after start-up is recorded while its step runs: the recording
    is that step's one forward (no scratch forward and eager check beside it), later steps of
    that size replay without a forward, and the tokens stay the eager ones."""
    prompts, params = random_prompts(5, 11, seed=4), _params(5)
    with _engine(tiny_paths["llama"], disable_cuda_graph=True) as engine:
        eager = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with _engine(tiny_paths["llama"]) as engine:
        calls, records = _count_decode_forwards(engine), tape.records
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        recorded = tape.records - records
        replays = engine.get_stats()["cuda_graph_replays"]
    assert got == eager
    assert recorded >= 3 and calls[0] == recorded  # one forward per new size: its recording
    assert replays > recorded  # the other steps of those sizes replayed


def test_a_failed_live_recording_runs_its_step_eagerly(tiny_paths, monkeypatch):
    """A recording that fails after the forward wrote K/V leaves the step to the eager path
    (which writes them again): same tokens, and that size runs eagerly from then on."""
    prompts, params = random_prompts(3, 9, seed=6), [{"temperature": 0.0, "max_new_tokens": 6,
                                                      "ignore_eos": True}] * 3
    with _engine(tiny_paths["llama"], disable_cuda_graph=True) as engine:
        eager = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with _engine(tiny_paths["llama"]) as engine:
        graphs = engine.runner.graph_runner

        def broken(fn, batch, vocab):
            fn()  # the forward ran (its K/V written), then the recording is refused
            raise tape.TapeError("refused for the test")
        monkeypatch.setattr(graphs.capturer, "capture_live", broken)
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert 3 not in graphs.sizes and 3 not in graphs.graphs
    assert got == eager


def test_a_live_recording_checks_token_ids_first(tiny_paths):
    with _engine(tiny_paths["llama"]) as engine:
        graphs = engine.runner.graph_runner
        batch = graphs._static_batch(2)
        vocab = graphs.graphs[1].vocab
        records = tape.records
        with torch.inference_mode():
            graphs.input_ids[1] = vocab
            with pytest.raises(IndexError, match="out of range"):
                graphs.capturer.capture_live(lambda: engine.runner.model(batch), batch, vocab)
            graphs.input_ids.zero_()
        assert tape.records == records


# ----------------------------------------------------------------- recording
def _kernels():
    return cpu_kernels.load()


def test_recording_replays_the_kernel_calls():
    k = _kernels()
    x = torch.randn(3, 64)
    w = torch.rand(64) + 0.5
    arena = tape.Arena()

    def fn():
        return k.silu_mul(k.rmsnorm(x, w, 1e-6))

    out, t = tape.record(fn, arena, k.lib)
    assert len(t) == 2 and out.data_ptr() >= arena.chunks[0].data_ptr()
    expected = out.clone()
    out.zero_()
    x.mul_(2)  # the tape reads the input buffer at replay: new values, new result
    t.run()
    assert torch.equal(out, k.silu_mul(k.rmsnorm(x, w, 1e-6)))
    assert not torch.equal(out, expected)


def test_recording_refuses_computing_torch_ops():
    k = _kernels()
    x = torch.randn(2, 32)
    w = torch.ones(32)
    with pytest.raises(tape.TapeError, match="torch op .*add"):
        tape.record(lambda: k.rmsnorm(x + 1, w, 1e-6), tape.Arena(), k.lib)
    with pytest.raises(tape.TapeError, match="copied data"):
        tape.record(lambda: k.rmsnorm(x.t().reshape(2, 32), w, 1e-6), tape.Arena(), k.lib)
    with pytest.raises(tape.TapeError, match="called no kernel"):
        tape.record(lambda: x.view(64), tape.Arena(), k.lib)
    assert not tape.recording()


def test_recording_refuses_a_kernel_without_twin_or_with_a_result():
    k = _kernels()
    x = torch.randn(2, 8)
    with pytest.raises(tape.TapeError, match="rs_pack has no tape twin"):
        tape.record(lambda: k.pack(x), tape.Arena(), k.lib)
    with pytest.raises(tape.TapeError, match="returns a value"):
        tape.record(lambda: k.lib.rs_panel_width(), tape.Arena(), k.lib)
    # the libraries are restored: plain calls work again, unrecorded
    assert k.pack(x).shape[0] >= 1 and not tape.recording()


def test_other_threads_calls_are_not_recorded():
    k = _kernels()
    x = torch.randn(2, 16)
    w = torch.ones(16)
    done = threading.Event()

    def other():
        k.rmsnorm(x, w, 1e-6)  # runs while the main thread records
        done.set()

    def fn():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        return k.rmsnorm(x, w, 1e-6)

    out, t = tape.record(fn, tape.Arena(), k.lib)
    assert done.is_set() and len(t) == 1


def test_ngram_verify_steps_replay_tapes_with_the_eager_tokens(tiny_paths):
    """Speculative verify steps (NGRAM drafts of varying size, several requests) replay one
    tape per node count and give the tokens of eager verify steps."""
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],  # repeated n-grams: the proposer drafts
               [40, 41, 42, 40, 41, 42, 40, 41], [100, 3, 77, 100, 3, 77, 100, 3, 77, 100]]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    got, stats = {}, {}
    for mode in ("tape", "eager"):
        with _engine(tiny_paths["llama"], speculative_algorithm="ngram", speculative_disable_by_batch_size=64,
                     disable_cuda_graph=mode == "eager") as engine:
            got[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            stats[mode] = engine.get_stats()
    assert got["tape"] == got["eager"]
    assert stats["tape"]["verify_tape_replays"] > 0 and len(stats["tape"]["verify_tape_replays_by_nodes"]) >= 2
    assert "verify_tape_replays" not in stats["eager"]
