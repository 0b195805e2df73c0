"""The multi-rank runtime: ``Engine(tp_size=N)`` starts N-1 follower processes that follow
rank 0's steps (radixserve.distributed.ranks / step_sync), on CPU ranks over gloo.

* Same greedy tokens as one rank: the default model at tp 2; a tiny Llama at tp 2 through
  the paths that write the request-to-token table behind the followers' backs (a cached
  prefix, chunked prefill, pages of 4, a prompt's logits); a tiny MoE model at tp 2,
  tp 2 x ep 2 (transports none and torch_distributed) and tp 4 x ep 2 (torch_distributed); two "nodes" on
  loopback (``--nnodes 2``, node 1 started
  as ``radixserve serve --node-rank 1``), which exits 0 when the replica stops: tp 2, tp 4,
  pp 2 (a stage per node).
* A follower killed while a request runs: the request ends with EngineError at once, the
  engine refuses further work, shutdown returns.
* A follower killed while the engine starts: Engine() raises RanksFailed naming it, fast.
* The step channel: one fixed-size broadcast, a second one for a longer message.
* On two GPUs (NCCL, skipped without them): the same tokens as one GPU.
* NGRAM speculative decoding at tp 2: the same tokens, its K/V moves mirrored.
* What tp > 1 refuses: HiCache, draft-model speculative decoding, an engine on node 1.

The server-side behaviour (exit codes, killed ranks) is in server/tests/test_multi_rank_http.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from radixserve.config import ConfigError
from radixserve.distributed import free_port
from radixserve.distributed.step_sync import RanksFailed
from radixserve.engine.engine import Engine, EngineError
from radixserve.testing.multi_rank import run_ranks
from tiny_models import build_checkpoint, random_prompts

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
CPU = dict(device="cpu", num_threads=1, max_total_tokens=2048, log_level="warning")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    build_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_moe"))
    build_checkpoint(path, "qwen2_moe")  # shared expert, a dense layer, top-4 of 8
    return path


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _table_workload(engine: Engine) -> dict:
    """Requests whose K/V slots reach the followers in every way rank 0 writes them."""
    a, b = random_prompts(2, 30, seed=3)
    first = _ids(engine.generate(input_ids=[a, b], sampling_params=GREEDY))
    # a later request on a's first 24 tokens: its prefix comes from the radix cache
    hit = engine.generate(input_ids=a[:24] + [7, 8, 9], sampling_params=GREEDY)
    logits = engine.runner.prompt_logits(a[:12])  # borrowed pages, its own row
    return {"first": first, "hit": hit["output_ids"], "cached": hit["meta_info"]["cached_tokens"],
            "argmax": logits.argmax(-1).tolist()}


def test_tp2_tiny_llama_follows_every_table_write(tiny_llama):
    kw = dict(CPU, page_size=4, chunked_prefill_size=8)
    with Engine(tiny_llama, **kw) as one:
        expected = _table_workload(one)
    with Engine(tiny_llama, tp_size=2, **kw) as two:
        got = _table_workload(two)
    assert expected["cached"] >= 20
    assert got == expected


def test_tp2_with_overlap_scheduling(tiny_llama):
    """--enable-overlap-schedule on two ranks: the worker sends each step as it starts it while
    the scheduler writes the next step's table entries; the tokens stay one rank's."""
    prompts = random_prompts(4, 12, seed=5)
    params = {**GREEDY, "max_new_tokens": 30}
    with Engine(tiny_llama, **CPU) as one:
        expected = _ids(one.generate(input_ids=prompts, sampling_params=params))
    with Engine(tiny_llama, tp_size=2, enable_overlap_schedule=True, enable_leak_check=True, **CPU) as two:
        assert _ids(two.generate(input_ids=prompts, sampling_params=params)) == expected
        assert two.get_stats()["num_overlap_steps"] > 0


@pytest.mark.slow
def test_tp2_default_model_same_greedy_tokens():
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with Engine(**CPU) as one:
        expected = _ids(one.generate(prompts, GREEDY))
    with Engine(tp_size=2, **CPU) as two:
        got = _ids(two.generate(prompts, GREEDY))
    assert got == expected


@pytest.fixture(scope="module")
def moe_expected(tiny_moe):
    prompts = random_prompts(3, 12, seed=5)
    with Engine(tiny_moe, **CPU) as one:
        return prompts, _ids(one.generate(input_ids=prompts, sampling_params=GREEDY))


@pytest.mark.parametrize("tp,ep,a2a,tbo", [(2, 1, "none", True), (2, 2, "none", False),
                                           (2, 2, "torch_distributed", False), (4, 2, "torch_distributed", True)])
def test_moe_tp_ep_same_greedy_tokens(tiny_moe, moe_expected, tp, ep, a2a, tbo):
    """TP/EP over each transport; two of them with two-batch overlap (--enable-two-batch-overlap:
    moe-tp slices summed through the asynchronous all-reduce, then through the sync one after
    the transport's combine)."""
    prompts, expected = moe_expected
    with Engine(tiny_moe, tp_size=tp, ep_size=ep, moe_a2a_backend=a2a, enable_two_batch_overlap=tbo, **CPU) as engine:
        assert _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == expected
        assert (engine.runner.two_batch.num_steps > 0) if tbo else engine.runner.two_batch is None


@pytest.mark.parametrize("tp,extra", [(2, {}), (4, {}), (1, {"pp_size": 2})], ids=["tp2", "tp4", "pp2"])
def test_two_nodes_on_loopback(tiny_llama, tp, extra):
    """Node 0 is this process's Engine; node 1 is ``radixserve serve --node-rank 1`` (no
    server), which exits 0 when the engine shuts down. Pipeline stages split across the nodes
    too (pp 2: one stage per node)."""
    prompts = random_prompts(2, 10, seed=9)
    with Engine(tiny_llama, **CPU) as one:
        expected = _ids(one.generate(input_ids=prompts, sampling_params=GREEDY))
    addr = f"127.0.0.1:{free_port()}"
    flags = [a for k, v in extra.items() for a in ([f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)]))]
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--model", tiny_llama,
                              "--tp-size", str(tp), "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--device", "cpu", "--num-threads", "1", "--max-total-tokens", "2048",
                              "--log-level", "warning", *flags])
    try:
        with Engine(tiny_llama, tp_size=tp, nnodes=2, dist_init_addr=addr, **extra, **CPU) as engine:
            assert _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == expected
        assert node1.wait(timeout=15) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def assert_a_killed_follower_ends_the_request(engine, input_ids: list[int], max_new_tokens: int) -> None:
    """Kill ``engine``'s one follower rank while a long request runs: the request must end with
    EngineError naming rank 1 (no hang), and no follower may outlive the engine's shutdown."""
    try:
        (pid,) = _follower_pids()
        outcome: dict = {}

        def long_request() -> None:
            try:
                engine.generate(input_ids=input_ids, sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                                      "max_new_tokens": max_new_tokens})
            except BaseException as e:  # noqa: BLE001 - what the test checks
                outcome["error"] = e

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=15)
        assert not thread.is_alive(), "the request hung after a rank died"
        assert isinstance(outcome.get("error"), EngineError) and "rank 1" in str(outcome["error"]), outcome
    finally:
        engine.shutdown()
    assert _follower_pids() == []


def _follower_pids() -> list[int]:
    """This process's children that are follower ranks."""
    me, pids = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if ppid == me and "radixserve.distributed.ranks" in cmd:
            pids.append(int(d))
    return pids


def test_killed_follower_fails_running_request_and_engine(tiny_llama):
    engine = Engine(tiny_llama, tp_size=2, **CPU)
    try:
        (pid,) = _follower_pids()
        outcome: dict = {}

        def long_request() -> None:
            try:
                outcome["out"] = engine.generate(input_ids=[5, 6, 7], sampling_params={
                    "max_new_tokens": 200, "temperature": 0, "ignore_eos": True})
            except BaseException as e:  # noqa: BLE001 - what the test checks
                outcome["error"] = e
            outcome["at"] = time.monotonic()

        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})  # the loop thread runs
        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=15)
        assert not thread.is_alive(), "the request hung after its follower died"
        assert isinstance(outcome.get("error"), EngineError), outcome
        assert "rank 1 was killed by SIGKILL" in str(outcome["error"])
        assert outcome["at"] - killed_at < 5
        with pytest.raises(EngineError, match="rank 1"):
            engine.generate(input_ids=[5, 6], sampling_params=GREEDY)
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 10
    assert _follower_pids() == []


def test_follower_killed_while_starting_fails_the_engine_at_once(tiny_llama):
    killed: list[int] = []

    def kill_first_follower() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for pid in _follower_pids():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    thread = threading.Thread(target=kill_first_follower)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(RanksFailed, match="rank 1 was killed by SIGKILL"):
            Engine(tiny_llama, tp_size=2, **CPU)
    finally:
        thread.join()
    assert killed and time.monotonic() - started < 15
    assert _follower_pids() == []


def _channel_ranks(rank, world_size, init_method):
    from radixserve.distributed import init_parallel_state
    from radixserve.distributed.step_sync import MessageChannel

    init_parallel_state(tp_size=world_size, ep_size=1, tp_rank=rank, init_method=init_method,
                        device=torch.device("cpu"))
    channel = MessageChannel(capacity=64)
    messages = [("small", [1, 2]), ("large", np.arange(1000)), ("exact", b"x" * 40), ("after", None)]
    got = []
    for m in messages:
        if rank == 0:
            channel.send(m)
        else:
            got.append(channel.recv())
    return got


def test_message_channel_one_broadcast_or_two():
    _, got = run_ranks(_channel_ranks, 2)
    assert [m[0] for m in got] == ["small", "large", "exact", "after"]
    assert got[0][1] == [1, 2] and (got[1][1] == np.arange(1000)).all() and got[2][1] == b"x" * 40


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL runtime needs 2 CUDA devices (one per rank)")
def test_tp2_on_two_gpus_same_greedy_tokens(tiny_llama):
    prompts = random_prompts(2, 10, seed=4)
    kw = dict(device="cuda", dtype="float32", max_total_tokens=2048)
    with Engine(tiny_llama, **kw) as one:
        expected = _ids(one.generate(input_ids=prompts, sampling_params=GREEDY))
    with Engine(tiny_llama, tp_size=2, **kw) as two:
        assert str(two.runner.device).startswith("cuda")
        assert _ids(two.generate(input_ids=prompts, sampling_params=GREEDY)) == expected


def test_tp2_ngram_speculative_mirrors_kv_moves(tiny_llama):
    """NGRAM drafts trees; an accepted side branch moves its K/V onto the path's slots on
    rank 0 (runner.move_kv), and the followers must do the same before their next step."""
    prompts = [[5, 6, 7, 8, 9, 10] * 4 + [5, 6, 7], [20, 21, 22, 20, 21, 23, 20, 21, 24, 20, 21]]
    params = dict(GREEDY, max_new_tokens=40)
    with Engine(tiny_llama, **CPU) as one:
        expected = _ids(one.generate(input_ids=prompts, sampling_params=params))
    # speculation on for the 2-request batch, and full-width drafts after one-token matches
    # (the method's defaults are batch 1 only and 2n - 1 tokens after an n-token match), whose
    # several continuations make the trees with side branches this test needs
    with Engine(tiny_llama, tp_size=2, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                speculative_ngram_min_match_window_size=1, speculative_ngram_draft_ratio=0,
                speculative_disable_by_batch_size=1 << 20, **CPU) as engine:
        moved = []
        move_kv = engine.runner.move_kv

        def counting_move_kv(src, dst):
            moved.append(len(src))
            move_kv(src, dst)

        engine.runner.move_kv = counting_move_kv
        assert _ids(engine.generate(input_ids=prompts, sampling_params=params)) == expected
        assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    assert sum(moved) > 0  # the workload exercises the mirrored moves (without them the tokens differ)


def test_a_follower_node_rank_is_refused_in_an_engine(tiny_llama):
    with pytest.raises(ConfigError, match="only node 0 runs the engine"):
        Engine(tiny_llama, tp_size=2, **{**CPU, "nnodes": 2, "node_rank": 1, "dist_init_addr": "127.0.0.1:1"})


def test_dist_timeout_bounds_the_wait_for_a_node_that_never_comes(tiny_llama):
    """--nnodes 2 with node 1 never started: rank 0 gives up after --dist-timeout, naming
    it, instead of waiting for the default timeout (or forever)."""
    started = time.monotonic()
    with pytest.raises(RanksFailed, match="--dist-timeout 3 s"):
        Engine(tiny_llama, tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=3, **CPU)
    assert 2.5 < time.monotonic() - started < 30
    assert _follower_pids() == []
