"""Rank processes of one multi-rank replica: start, rendezvous, supervise, stop.

A replica of ``--tp-size N`` runs N ranks, ``N / --nnodes`` per node (node ``R`` holds ranks
``R * N/nnodes`` ...). Node 0's engine process is rank 0: scheduler, tokenizer, sampling,
and :class:`radixserve.distributed.step_sync.StepDriver`. Every other rank is a follower
process (``python -m radixserve.distributed.ranks``) started by its node: by the engine
on node 0 (:class:`ReplicaRanks`), by ``radixserve serve --node-rank R`` elsewhere
(:func:`run_follower_node`). All join one ``torch.distributed`` world at
``--dist-init-addr`` (default: a free port on 127.0.0.1), build their ``ModelRunner`` and
follow rank 0's steps.

Supervision, so that nothing hangs:

- the node watches its followers; one that exits (crash, ``kill -9``) is reported at
  once (``on_failure``) and the replica stops; on node 0 the engine fails loudly;
- a follower reads its parent's pipe (its stdin) and exits the moment the parent is gone;
- a rank on another node that dies is found by rank 0's next step or heartbeat
  (:data:`radixserve.distributed.step_sync.HEARTBEAT_S`): gloo reports a closed
  connection at once, and ``--dist-timeout`` bounds every collective otherwise;
- followers whose rank 0 went away see their next collective fail and exit non-zero.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from radixserve.config import ServerArgs
from radixserve.distributed import (
    destroy_parallel_state,
    init_parallel_state,
    local_init_method,
)
from radixserve.distributed.step_sync import RanksFailed, StepDriver

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # followers get this long to leave after the stop message, then are killed
EXIT_NOTICE_S = 0.5  # after a failed collective, how long to look for the local rank that died


def node_ranks(args: ServerArgs) -> list[int]:
    """The ranks node ``--node-rank`` runs."""
    per_node = args.world_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def rank_device(args: ServerArgs, rank: int) -> torch.device:
    """The device of ``rank``: its own GPU on a CUDA node (by local rank), else the CPU."""
    from radixserve.engine.model_runner import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        local = rank % (args.world_size // args.nnodes)
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return device


def check_devices(args: ServerArgs) -> None:
    """On CUDA every rank of this node needs its own GPU (NCCL refuses two ranks on one)."""
    from radixserve.config import ConfigError
    from radixserve.engine.model_runner import resolve_device

    if resolve_device(args.device).type != "cuda":
        return
    per_node, visible = args.world_size // args.nnodes, torch.cuda.device_count()
    if visible < per_node:
        raise ConfigError(f"--tp-size {args.tp_size} over --nnodes {args.nnodes}: each node runs {per_node} ranks, "
                          f"one per GPU, but {visible} GPU(s) are visible here; lower --tp-size, raise --nnodes "
                          f"or use --device cpu")


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankProcesses:
    """This node's follower processes, each watched by a thread.

    ``on_exit(rank, code)`` is called (on the watcher's thread) when one exits before
    :meth:`stop`. Each follower's stdin stays open until it has exited: the follower
    exits as soon as it reads end-of-file, i.e. when this process is gone.
    """

    def __init__(self, args: ServerArgs, ranks: list[int], init_method: str,
                 on_exit: Callable[[int, int], None]) -> None:
        self.on_exit = on_exit
        self.stopping = False
        self.procs: dict[int, subprocess.Popen] = {}
        self._joining: dict[int, int] = {}  # rank -> read end of the pipe it says "joining" on
        for rank in ranks:
            read_fd, write_fd = os.pipe()
            try:
                proc = subprocess.Popen([sys.executable, "-m", "radixserve.distributed.ranks"], stdin=subprocess.PIPE,
                                        pass_fds=(write_fd,))
            finally:
                os.close(write_fd)
            self._joining[rank] = read_fd
            payload = pickle.dumps((args, rank, init_method, write_fd))
            try:
                proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
                proc.stdin.flush()
            except BrokenPipeError:  # it died before reading its arguments: wait_joining names it
                logger.debug("rank %d exited before it read its arguments", rank)
            self.procs[rank] = proc
            threading.Thread(target=self._watch, args=(rank, proc), name=f"radixserve-rank{rank}-watch",
                             daemon=True).start()
        logger.info("started ranks %s (pids %s)", ranks, [p.pid for p in self.procs.values()])

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:
            self.on_exit(rank, code)

    def wait_joining(self, timeout_s: float, where: str) -> None:
        """Return once every follower is about to join the rendezvous (imports done); raise
        RanksFailed at once if one exits first, or after ``timeout_s``."""
        import select

        deadline = time.monotonic() + timeout_s
        while self._joining:
            dead = self.exited()
            if dead:
                rank, code = min(dead.items())
                raise RanksFailed(f"rank {rank} {describe_code(code)} before joining the rendezvous at {where} "
                                  f"(see its log above)")
            if time.monotonic() > deadline:
                raise RanksFailed(f"ranks {sorted(self._joining)} did not reach the rendezvous at {where} within "
                                  f"--dist-timeout {timeout_s:g} s")
            ready, _, _ = select.select(list(self._joining.values()), [], [], 0.1)
            for rank, fd in list(self._joining.items()):
                if fd not in ready:
                    continue
                said = os.read(fd, 1)  # b"J"; b"" when it exited without a word
                os.close(self._joining.pop(rank))
                if not said:
                    try:
                        how = describe_code(self.procs[rank].wait(timeout=5))
                    except subprocess.TimeoutExpired:
                        how = "closed its pipe"
                    raise RanksFailed(f"rank {rank} {how} before joining the rendezvous at {where} "
                                      f"(see its log above)")

    def exited(self) -> dict[int, int]:
        """Exit codes of the followers that have exited, by rank."""
        return {rank: p.returncode for rank, p in self.procs.items() if p.poll() is not None}

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[int, int]:
        """Wait up to ``grace_s`` for every follower to exit, then kill the rest; their codes."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not stop within %.0f s; killing it", rank, grace_s)
                proc.kill()
                proc.wait()
        for proc in self.procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        for fd in self._joining.values():
            os.close(fd)
        self._joining.clear()
        return {rank: p.returncode for rank, p in self.procs.items()}


class ReplicaRanks:
    """Rank 0's side of a multi-rank replica: starts node 0's followers, joins the
    rendezvous, and after :meth:`attach` drives every step through a StepDriver.

    ``on_failure(reason)`` is called once, from a watcher thread, when a rank dies or
    loses step; every later forward step raises RanksFailed.
    """

    def __init__(self, args: ServerArgs, on_failure: Callable[[str], None]) -> None:
        self.args = args
        self.on_failure = on_failure
        self.failure: str | None = None
        self.driver = None
        self._lock = threading.Lock()
        check_devices(args)
        init_method = local_init_method(args.dist_init_addr)
        self.procs = RankProcesses(args, node_ranks(args)[1:], init_method, self._on_exit)
        self.device = rank_device(args, 0)
        try:
            self._join(init_method)
        except BaseException:
            self.procs.stop(grace_s=0)
            raise

    def _join(self, init_method: str) -> None:
        """Join the rendezvous as rank 0 once this node's followers are about to (their
        start-up, the slow part, is watched: one that dies fails at once and leaves no
        rendezvous half done in this process)."""
        a = self.args
        self.procs.wait_joining(a.dist_timeout, init_method)
        try:
            init_parallel_state(tp_size=a.tp_size, ep_size=a.ep_size, tp_rank=0, pp_size=a.pp_size,
                                cp_size=a.attn_cp_size, attn_dp_size=a.attn_dp_size, init_method=init_method,
                                device=self.device, timeout_s=a.dist_timeout)
        except Exception as e:
            raise RanksFailed(f"the ranks could not meet at {init_method} within --dist-timeout "
                              f"{a.dist_timeout:g} s: {self.dead_rank() or e}") from e
        logger.info("rank 0 of %d joined at %s", a.world_size, init_method)

    def attach(self, runner) -> None:
        """Drive ``runner``'s forward passes: each is first sent to the other ranks."""
        self.driver = StepDriver(runner.req_to_token_pool.req_to_token, on_failure=self._report)
        runner.step_driver = self.driver
        if self.failure is not None:  # a rank died while the model loaded
            self.driver.fail(self.failure)

    def _on_exit(self, rank: int, code: int) -> None:
        reason = f"rank {rank} {describe_code(code)}"
        if self.driver is not None:
            self.driver.fail(reason)  # reports through _report
        else:
            self._report(reason)

    def dead_rank(self, wait_s: float = EXIT_NOTICE_S) -> str | None:
        """"rank R <how it ended>" for a local follower that has exited (waiting up to
        ``wait_s`` for one to be reaped), else None."""
        deadline = time.monotonic() + wait_s
        while not (dead := self.procs.exited()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not dead:
            return None
        rank, code = min(dead.items())
        return f"rank {rank} {describe_code(code)}"

    def _report(self, reason: str) -> None:
        if not self.procs.stopping:  # a collective failed: name the local rank that died, if one did
            reason = self.dead_rank() or reason
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        self.on_failure(reason)

    def shutdown(self) -> None:
        """Stop the followers (cleanly when the replica is healthy) and leave the world."""
        self.procs.stopping = True  # followers leaving now is no failure
        sent = self.driver.stop() if self.driver is not None else False
        codes = self.procs.stop(grace_s=STOP_GRACE_S if sent else 0.5)
        bad = {r: c for r, c in codes.items() if c != 0}
        if sent and bad:
            logger.warning("ranks stopped with codes %s", bad)
        if sent:
            destroy_parallel_state()
        else:  # a peer is gone: a clean destroy may wait on it; just forget the world
            _forget_world()


def _forget_world() -> None:
    from radixserve.distributed import ParallelState, set_parallel_state

    try:
        destroy_parallel_state()
    except Exception:  # noqa: BLE001 - the peers are gone
        logger.debug("could not destroy the process group", exc_info=True)
    set_parallel_state(ParallelState())


# ----------------------------------------------------------------- followers
def run_follower(args: ServerArgs, rank: int, init_method: str, joining_fd: int | None = None) -> None:
    """One follower rank: join, load this rank's part of the model, follow rank 0's steps."""
    from radixserve.distributed.step_sync import follow_steps
    from radixserve.engine.model_runner import ModelRunner
    from radixserve.model_loader import load_checkpoint
    from radixserve.registry import get_registry

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = rank_device(args, rank)
    if joining_fd is not None:  # tell the node's process: imports done, joining now
        os.write(joining_fd, b"J")
        os.close(joining_fd)
    init_parallel_state(tp_size=args.tp_size, ep_size=args.ep_size, tp_rank=rank, pp_size=args.pp_size,
                        cp_size=args.attn_cp_size, attn_dp_size=args.attn_dp_size, init_method=init_method,
                        device=device, timeout_s=args.dist_timeout)
    registry = get_registry()
    runner = ModelRunner(args, load_checkpoint(args.model, registry), registry)
    services = []  # what this rank keeps of its own KV besides the pool, driven by rank 0's calls
    if args.disaggregation_mode != "null":  # it moves its own KV heads between servers
        from radixserve.disaggregation.agent import KVAgent

        services.append(KVAgent(args, registry, runner))
    if args.enable_hierarchical_cache:  # its own heads' pages in host memory and storage
        from radixserve.hicache.mirror import FollowerHiCache

        services.append(FollowerHiCache(args, registry, runner))
    logger.info("rank %d of %d ready", rank, args.world_size)
    try:
        follow_steps(runner, {name: fn for s in services for name, fn in s.handlers().items()})
    finally:
        for s in services:
            s.close()
    destroy_parallel_state()


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the parent closed the pipe before sending this rank's arguments")
        data += chunk
    return data


def _exit_when_parent_gone(fd: int) -> None:
    while os.read(fd, 4096):  # returns b"" at end-of-file: the parent closed the pipe or died
        pass
    os._exit(1)


def follower_main() -> int:
    """Entry point of a follower process: its (args, rank, init_method) arrive on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's process decides when ranks stop
    fd = sys.stdin.fileno()
    size = int.from_bytes(_read_exactly(fd, 8), "little")
    args, rank, init_method, joining_fd = pickle.loads(_read_exactly(fd, size))
    threading.Thread(target=_exit_when_parent_gone, args=(fd,), name="radixserve-parent-watch",
                     daemon=True).start()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    try:
        run_follower(args, rank, init_method, joining_fd)
    except BaseException as e:  # noqa: BLE001 - the exit code tells the node
        logger.error("rank %d stops: %s: %s", rank, type(e).__name__, e, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 1
    return 0


def run_follower_node(args: ServerArgs) -> int:
    """``radixserve serve --nnodes N --node-rank R`` (R > 0): run this node's ranks, no
    server. Returns 0 when the replica stopped cleanly, 1 when a rank failed."""
    check_devices(args)
    init_method = local_init_method(args.dist_init_addr)
    failed: list[str] = []
    wake = threading.Event()

    def on_exit(rank: int, code: int) -> None:
        if code != 0:
            failed.append(f"rank {rank} {describe_code(code)}")
        wake.set()

    procs = RankProcesses(args, node_ranks(args), init_method, on_exit)
    stop_signal: list[int] = []

    def on_signal(sig, frame) -> None:
        stop_signal.append(sig)
        wake.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            wake.wait(1.0)
            wake.clear()
            if failed or stop_signal or len(procs.exited()) == len(procs.procs):
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        codes = procs.stop(grace_s=0 if (failed or stop_signal) else STOP_GRACE_S)
    if failed:
        print(f"radixserve: error: node {args.node_rank}: {failed[0]}", file=sys.stderr)
        return 1
    if stop_signal:
        return 0
    return 0 if all(c == 0 for c in codes.values()) else 1


__all__ = ["ReplicaRanks", "RankProcesses", "RanksFailed", "node_ranks", "rank_device",
           "run_follower_node", "follower_main", "describe_code", "check_devices"]

if __name__ == "__main__":
    code = follower_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: the parent-watch thread may still be reading
