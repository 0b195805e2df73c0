"""The multi-rank trust boundary: rank 0 serves the rendezvous (and gloo its connections)
on the interface of ``--dist-init-addr`` only, loopback by default; step messages travel in
a fixed schema (radixserve.distributed.wire), so a follower refuses anything else and never
unpickles what it receives."""

from __future__ import annotations

import enum
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from radixserve.distributed.rendezvous import interface_of, split_init_method
from radixserve.distributed.wire import Decoder, Encoder, WireFormatError
from radixserve.layers.attention import ForwardMode
from radixserve.testing.multi_rank import run_ranks

WIRE = (ForwardMode,)


# ------------------------------------------------------------------ rendezvous
def _listening(rank, world_size, init_method):
    import psutil
    from radixserve.distributed import init_parallel_state
    from radixserve.distributed.step_sync import MessageChannel

    init_parallel_state(tp_size=world_size, ep_size=1, tp_rank=rank, init_method=init_method,
                        device=torch.device("cpu"))
    channel = MessageChannel()  # the ranks have talked over gloo: its sockets are open
    got = channel.send(("ping", None)) if rank == 0 else channel.recv()
    sockets = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN]
    return sockets, got, os.environ.get("GLOO_SOCKET_IFNAME"), split_init_method(init_method)[1]


def test_the_rendezvous_and_gloo_listen_on_loopback_only():
    pytest.importorskip("psutil", reason="psutil lists a process's listening sockets")
    (rank0, _, ifname, store_port), (rank1, got, _, _) = run_ranks(_listening, 2)
    assert got == ("ping", None)
    assert ("127.0.0.1", store_port) in rank0, f"rank 0 must serve the rendezvous on loopback: {rank0}"
    for ip, port in rank0 + rank1:
        assert ip == "127.0.0.1", f"a rank listens on {ip}:{port}, reachable from other hosts"
    assert ifname == interface_of("127.0.0.1") is not None


# ------------------------------------------------------------------ wire schema
class Boom:
    """Unpickling it would create ``path`` (code run by the receiver)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Colour(enum.Enum):
    RED = 1


def a_step(n=3):
    ids = np.arange(n, dtype=np.int64)
    return ("step", {"mode": ForwardMode.DECODE, "batch_size": n, "input_ids": ids, "seq_lens_cpu": [5] * n,
                     "tree_mask": None, "capture_final_hidden": False, "capture_hidden_layers": (1, 2),
                     "table": (ids, ids.astype(np.int32), np.zeros((0,), np.int64)), "scale": 0.5, "name": "x",
                     "ops": [("move_kv", ids[::-1], ids)], "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
                     "mask": np.array([True, False]), "raw": b"\x00\x01", "big": [1, -(1 << 63), True]})


def test_a_step_message_round_trips_exactly():
    msg = a_step()
    got = Decoder(WIRE).loads(Encoder(WIRE).dumps(msg))
    kind, fields = got
    assert kind == "step" and fields.keys() == msg[1].keys()
    assert fields["mode"] is ForwardMode.DECODE and fields["capture_hidden_layers"] == (1, 2)
    assert fields["seq_lens_cpu"] == [5, 5, 5] and type(fields["seq_lens_cpu"]) is list
    assert fields["big"] == [1, -(1 << 63), True] and type(fields["big"][2]) is bool
    for a, b in zip(fields["table"], msg[1]["table"]):
        assert a.dtype == b.dtype and np.array_equal(a, b) and a.flags.writeable
    assert np.array_equal(fields["ops"][0][1], [2, 1, 0]) and fields["ops"][0][0] == "move_kv"
    assert torch.equal(fields["bf16"], msg[1]["bf16"]) and fields["bf16"].dtype == torch.bfloat16
    assert fields["mask"].dtype == np.bool_ and fields["raw"] == b"\x00\x01" and fields["scale"] == 0.5


@pytest.mark.parametrize("value", [
    Boom("/nonexistent"), {1, 2}, Colour.RED, np.array([object()], dtype=object), torch.ones(2, dtype=torch.float16),
    [1 << 64], 1 << 70, np.datetime64("2020-01-01"), SimpleNamespace(a=1),
], ids=lambda v: type(v).__name__)
def test_a_value_outside_the_schema_is_refused_when_sending(value):
    with pytest.raises(WireFormatError):
        Encoder(WIRE).dumps(("step", {"x": value}))


def test_a_pickle_payload_is_refused_and_never_run(tmp_path):
    target = tmp_path / "pwned"
    for payload in (pickle.dumps(Boom(str(target))), pickle.dumps(("step", {"x": Boom(str(target))}))):
        with pytest.raises(WireFormatError):
            Decoder(WIRE).loads(payload)
    assert not target.exists()
    good = Encoder(WIRE).dumps(a_step())
    enum_other = Encoder((Colour,)).dumps(Colour.RED)
    for bad in (good[:-1], good + b"N", b"Q", enum_other, good.replace(b"int64", b"objec"), b"L\xff\xff\xff\xff",
                b"L\x01\x00\x00\x00" * 40 + b"N"):
        with pytest.raises(WireFormatError):
            Decoder(WIRE).loads(bad)


def _follower_gets(rank, world_size, init_method, path):
    import torch.distributed as dist
    from radixserve.distributed import ParallelState, set_parallel_state
    from radixserve.distributed.step_sync import MessageChannel, RanksFailed, follow_steps

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    set_parallel_state(ParallelState(tp_rank=rank, tp_size=world_size, group=dist.group.WORLD,
                                     cpu_group=dist.group.WORLD))
    channel = MessageChannel()
    if rank == 0:  # a rank 0 (or anyone on its socket) that sends a pickle instead of a step
        data = pickle.dumps(("step", Boom(path)))
        channel.view[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        channel.view[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        dist.broadcast(channel.buf, 0, group=channel.group)
        return None
    runner = SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=SimpleNamespace(req_to_token=None))
    try:
        follow_steps(runner)
    except RanksFailed as e:
        return str(e)
    return "followed"


def test_a_follower_refuses_a_pickled_step_and_runs_none_of_it(tmp_path):
    target = tmp_path / "pwned"
    _, reason = run_ranks(_follower_gets, 2, str(target))
    assert "refused a step message from rank 0" in reason and "malformed" in reason
    assert not target.exists()


def _service_calls(rank, world_size, init_method):
    import torch.distributed as dist
    from radixserve.distributed import ParallelState, set_parallel_state
    from radixserve.distributed.step_sync import RankCallError, StepDriver, follow_steps

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    set_parallel_state(ParallelState(tp_rank=rank, tp_size=world_size, group=dist.group.WORLD,
                                     cpu_group=dist.group.WORLD))

    def boom(payload):
        if rank == 2:
            raise ValueError("not on this rank")
        return payload

    handlers = {"echo": lambda p: {"rank": rank, "got": p, "arr": np.arange(rank + 1)}, "boom": boom}
    if rank != 0:
        follow_steps(SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=SimpleNamespace(req_to_token=None)),
                     handlers)
        return "followed"
    driver = StepDriver(torch.zeros(2, 2, dtype=torch.int64))
    got = [driver.call("echo", [1, "x"], handlers)]
    errors = []
    for name in ("boom", "missing"):
        try:
            driver.call(name, None, handlers)
        except RankCallError as e:
            errors.append(str(e))
    got.append(driver.call("echo", "x" * 70000, handlers))  # the replies are longer than a step message
    driver.stop()
    return got, errors, driver.failure


def test_service_calls_reach_every_rank_and_a_failing_handler_keeps_them_in_step():
    (got, errors, failure), *followers = run_ranks(_service_calls, 3)
    assert followers == ["followed", "followed"]
    first, long = got
    assert [r["rank"] for r in first] == [0, 1, 2] and all(r["got"] == [1, "x"] for r in first)
    assert [r["arr"].tolist() for r in first] == [[0], [0, 1], [0, 1, 2]]
    assert [len(r["got"]) for r in long] == [70000] * 3
    assert "rank 2" in errors[0] and "not on this rank" in errors[0]
    assert "rank 0" in errors[1] and "no handler" in errors[1]  # the first rank without it
    assert failure == "the replica was shut down"  # stopped cleanly, never failed
