"""Grammar compiles in worker processes that can be killed.

A backend that can move its compiled grammars between processes (it overrides
:meth:`~radixserve.grammar.GrammarBackend.serialize` and ``deserialize``, and pickles)
compiles in a child process, ``python -m radixserve.grammar.workers``: the parent sends the
pickled backend once, then one ``(kind, text)`` per compile, and reads back the compiled
grammar as bytes. A compile that runs past ``--grammar-compile-timeout`` is ended by
killing its process (SIGKILL), so it stops using CPU at once; the next compile gets a fresh
process. :class:`ProcessPool` keeps one process more than there are compile threads booted,
so a kill never leaves the next grammar waiting for a process to start (booting takes
seconds: the backends import torch). Children compile at a lower CPU priority than the
engine (:data:`WORKER_NICENESS`), and those replacing killed ones boot at it too. They die
with the engine: ``PR_SET_PDEATHSIG`` on Linux (compile threads, which start them, never
exit while the engine runs), and end-of-file on their stdin everywhere.

Frames are an 8-byte little-endian length and the bytes. Parent to child: the pickled
``(backend, json_bounds)`` first, then each job as JSON ``[kind, text]``. Child to parent:
:data:`READY` once the backend is built, then per job a status byte (:data:`COMPILED`,
:data:`INVALID`: a ``GrammarError``, :data:`FAILED`: any other exception) and a frame (the
serialized grammar, or the message as UTF-8). Nothing the child sends is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import IO, Any

logger = logging.getLogger(__name__)

READY, COMPILED, INVALID, FAILED = b"R", b"C", b"I", b"F"
WORKER_NICENESS = 10  # added to the child's nice value: compiles get the CPU the engine leaves
_PR_SET_PDEATHSIG = 1


def write_frame(f: IO[bytes], data: bytes) -> None:
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def read_exact(f: IO[bytes], n: int) -> bytes | None:
    """``n`` bytes, or None at end-of-file (the other side is gone)."""
    chunks, left = [], n
    while left:
        chunk = f.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(f: IO[bytes]) -> bytes | None:
    head = read_exact(f, 8)
    return None if head is None else read_exact(f, int.from_bytes(head, "little"))


class CompileProcess:
    """One child process; used by one compile thread at a time."""

    def __init__(self, init_payload: bytes, boot_niceness: int = 0) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "radixserve.grammar.workers", str(boot_niceness)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.popen.pid
        self.ready: bool | None = None  # None: not known yet
        self._ready_lock = threading.Lock()
        # the payload (the tokenizer's vocabulary, a few MB) goes while the child boots
        threading.Thread(target=self._send, args=(init_payload,), daemon=True,
                         name=f"radixserve-grammar-init-{self.pid}").start()

    def _send(self, payload: bytes) -> None:
        try:
            write_frame(self.popen.stdin, payload)
        except (OSError, ValueError):  # it died, or was closed: wait_ready reports it
            pass

    def wait_ready(self) -> bool:
        """Block until the child has built its backend; False if it exited instead."""
        with self._ready_lock:
            if self.ready is None:
                self.ready = read_exact(self.popen.stdout, 1) == READY
            return self.ready

    def compile(self, kind: str, text: str) -> tuple[bytes, bytes] | None:
        """``(status, payload)``, or None if the process died (killed at the time limit)."""
        try:
            write_frame(self.popen.stdin, json.dumps([kind, text]).encode())
        except OSError:
            return None
        status = read_exact(self.popen.stdout, 1)
        payload = None if status is None else read_frame(self.popen.stdout)
        return None if payload is None else (status, payload)

    def kill(self) -> None:
        try:
            self.popen.kill()
        except OSError:
            pass

    def close(self) -> int:
        """Kill it (if still running), reap it and close its pipes; its exit code."""
        self.kill()
        code = self.popen.wait()
        for f in (self.popen.stdin, self.popen.stdout):
            try:
                f.close()
            except OSError:
                pass
        return code


class ProcessPool:
    """Hands out compile processes to ``num_workers`` compile threads, keeping one more
    booted (or booting) for the next taker: ``num_workers + 1`` processes in all."""

    def __init__(self, backend: Any, json_bounds: tuple[int, int], num_workers: int) -> None:
        self._payload = pickle.dumps((backend, json_bounds))
        self.size = num_workers + 1
        self._idle: list[CompileProcess] = []  # oldest first: the likeliest to have booted
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self.live: set[CompileProcess] = set()  # every process not yet closed, idle or in use

    def take(self) -> CompileProcess:
        """The oldest idle process (booted or booting), or a new one; the pool is topped up
        to its size. All processes start with the first compile, at the engine's priority;
        later ones (replacing killed processes) boot at a lower one."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile processes are shut down")
            boot_niceness = WORKER_NICENESS if self._started else 0
            self._started = True
            if not self._idle:
                self._spawn(boot_niceness)
            proc = self._idle.pop(0)
            while len(self.live) < self.size:
                self._spawn(boot_niceness)
            return proc

    def _spawn(self, boot_niceness: int) -> None:
        proc = CompileProcess(self._payload, boot_niceness)
        self.live.add(proc)
        self._idle.append(proc)

    def wait_idle(self) -> bool:
        """Block until every idle process has booted; False if one failed to."""
        return all([proc.wait_ready() for proc in list(self._idle)])

    def release(self, proc: CompileProcess) -> int:
        """Close a process that is done with (killed, crashed or no longer needed)."""
        with self._lock:
            self.live.discard(proc)
        return proc.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs, self.live, self._idle = list(self.live), set(), []
        for proc in procs:
            proc.close()


# ------------------------------------------------------------------ child side
def _die_with_parent() -> None:
    """Exit when the engine's process dies. Linux sends the parent-death signal when the
    *thread* that started this process exits, not only the process: a compile thread that
    leaves (replaced while stuck) would take the spare processes it started with it. So the
    signal is SIGUSR1, and its handler exits only once this process has been re-parented."""
    parent = os.getppid()

    def on_parent_death(signum, frame) -> None:
        if os.getppid() != parent:
            os._exit(1)

    try:
        import ctypes

        signal.signal(signal.SIGUSR1, on_parent_death)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1))
    except (OSError, AttributeError, ValueError):  # not Linux: end-of-file on stdin still ends it
        return


def _nice(increment: int) -> None:
    try:
        os.nice(increment)
    except OSError:
        pass


def _serve(inp: IO[bytes], out: IO[bytes], boot_niceness: int) -> None:
    from radixserve.grammar import GrammarError
    from radixserve.grammar.bounds import bound_constraint

    payload = read_frame(inp)
    if payload is None:
        return
    backend, bounds = pickle.loads(payload)  # from the parent, which trusts itself
    _nice(WORKER_NICENESS - boot_niceness)  # compiles (clients' work) get the CPU the engine leaves
    out.write(READY)
    out.flush()
    while (job := read_frame(inp)) is not None:
        kind, text = json.loads(job)
        try:
            data = backend.serialize(backend.compile(*bound_constraint(kind, text, *bounds)))
            status = COMPILED
        except GrammarError as e:
            status, data = INVALID, (str(e) or "the grammar is invalid").encode()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which logs it
            status, data = FAILED, f"{type(e).__name__}: {e}".encode()
        out.write(status)
        write_frame(out, data)


def main() -> None:
    _die_with_parent()
    boot_niceness = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    _nice(boot_niceness)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a backend's prints must not corrupt the frames
    _serve(inp, out, boot_niceness)


if __name__ == "__main__":
    main()
