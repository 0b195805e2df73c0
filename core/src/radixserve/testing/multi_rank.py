"""Run a test function on several ranks, each in its own spawned process (CPU ranks over
gloo; the function may join with NCCL instead, one GPU per rank).

::

    from radixserve.testing.multi_rank import run_ranks

    def body(rank, world_size, init_method, case):  # top level: the child imports it
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        ...
        return something_picklable

    results = run_ranks(body, 2, case)  # [rank 0's result, rank 1's result]

The function joins the process group itself (so it can use
:func:`radixserve.distributed.init_parallel_state` or plain ``init_process_group``); the
group is destroyed after it returns. A rank that raises fails the call with its
traceback, and the other ranks are killed at once (they would otherwise wait in a
collective until gloo's timeout); so are all of them when ``timeout_s`` passes. Each child
uses one torch thread.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any


def _child(fn: Callable, rank: int, world_size: int, init_method: str, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        out = fn(rank, world_size, init_method, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(rank, world_size, init_method, *args) for rank in range(world_size)]``, each in
    its own process; raises AssertionError with the failing ranks' tracebacks."""
    from radixserve.distributed import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, init_method, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                running = sorted(set(range(world_size)) - set(out))
                failures.append(f"timed out after {timeout_s:.0f} s with ranks {running} still running")
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    failures.append(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                    break
                continue
            if ok:
                out[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError(f"{world_size}-rank run of {getattr(fn, '__name__', fn)} failed:\n" + "\n".join(failures))
    return [out[r] for r in range(world_size)]
