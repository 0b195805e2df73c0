"""The HTTP process's side of the engine: start the engine process, submit, stream, abort.

Pipe writes happen on a writer thread and reads on a reader thread, so the event loop
never blocks on the engine; updates reach each request's asyncio queue through
``loop.call_soon_threadsafe`` (through :func:`post`, which tolerates a loop that has
already closed during shutdown).

Engine death is noticed at once: the reader waits on both the pipe and the process's
sentinel, so a killed engine (``kill -9``, a crash) or one that reports ``("failed",
reason)`` fails every waiting request and call with :class:`EngineError` and calls
``on_death(reason)``; the HTTP server then exits non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from typing import Any

from radixserve_server.engine_proc import Update, engine_main
from radixserve_server.peer import PEER

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine process failed to start or died (or the server stopped the request)."""


def post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """``loop.call_soon_threadsafe(fn, *args)`` from another thread; False (and nothing
    done) when the loop is already closed, i.e. nobody is waiting any more."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "the engine process closed its pipe"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the engine process was killed by {name}"
    return f"the engine process exited with code {exitcode}"


class RequestHandle:
    """One engine request as seen from the HTTP process."""

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self.queue: asyncio.Queue[Update | EngineError] = asyncio.Queue()
        self.loop = loop
        self.finished = False

    async def updates(self):
        """Yield Updates until the finishing one (raises EngineError if the engine died)."""
        while True:
            item = await self.queue.get()
            if isinstance(item, EngineError):
                self.finished = True  # nothing left to abort
                raise item
            if item.finished:
                self.finished = True
            yield item
            if item.finished:
                return


class EngineClient:
    def __init__(self, engine_kwargs: dict, target: Callable = engine_main) -> None:
        self.engine_kwargs = engine_kwargs
        self.target = target  # the engine process's entry point (tests inject faults here)
        self.info: dict[str, Any] | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pinned: dict[str, int] = {}  # rid -> attention group asked for (routed_dp_rank)
        self.proc: mp.process.BaseProcess | None = None
        self.on_update: Callable[[Update], None] | None = None  # metrics hook (reader thread)
        self.on_death: Callable[[str], None] | None = None  # called once, on the reader thread
        self._closing = False
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=self.target, args=(self.engine_kwargs, to_engine_r, from_engine_w),
                                name="radixserve-engine", daemon=True)
        self.proc.start()
        to_engine_r.close()
        from_engine_w.close()
        self._send_conn, self._recv_conn = to_engine_w, from_engine_r
        self._threads = [threading.Thread(target=self._reader, name="radixserve-engine-reader", daemon=True),
                         threading.Thread(target=self._writer, name="radixserve-engine-writer", daemon=True)]
        for t in self._threads:
            t.start()

    def wait_ready(self, timeout: float | None = None) -> dict:
        if not self._ready.wait(timeout):
            raise EngineError("the engine did not start in time")
        if self.error is not None:
            raise EngineError(self.error)
        return self.info

    @property
    def started(self) -> bool:
        """The engine reported ready, or failed to start (then ``error`` says why)."""
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.error is None and self.proc.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine is not serving, once it failed or died (None while it starts or
        runs, and after a requested shutdown). Also right after a death the reader thread
        has not reported yet."""
        if self.error is not None:
            return None if self._closing else self.error
        if self.proc is not None and not self._closing and self.proc.pid is not None \
                and not self.proc.is_alive():
            return describe_exit(self.proc.exitcode)
        return None

    def shutdown(self, timeout: float = 10.0) -> int | None:
        """Stop the engine process; returns its exit code (0: clean, with no KV page leaked).
        Requests still waiting fail with EngineError; the reader and writer threads end."""
        if self.proc is None:
            return None
        self._closing = True
        if self._ready.is_set() and self.error is None:
            self._outbox.put(("shutdown",))
            self._outbox.put(None)
            self.proc.join(timeout)
        else:
            self._outbox.put(None)
        if self.proc.is_alive():  # still loading the model (or stuck): nothing to save
            self.proc.kill()
            self.proc.join(5)
        for t in self._threads:
            t.join(2.0)
        return self.proc.exitcode

    def fail_all(self, message: str) -> int:
        """End every waiting request now with EngineError(message) and abort it in the
        engine (a second Ctrl-C); returns how many there were. The engine keeps running."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            self._outbox.put(("abort", h.rid))
            post(h.loop, h.queue.put_nowait, EngineError(message))
        return len(handles)

    # ------------------------------------------------------------- threads
    def _writer(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._send_conn.send(msg)
            except (BrokenPipeError, OSError):  # the engine is gone; the reader reports it
                return

    def _reader(self) -> None:
        conn, sentinel = self._recv_conn, self.proc.sentinel
        try:
            while True:
                ready = mp_wait([conn, sentinel])
                if conn not in ready:  # the process ended: take what it sent before, then stop
                    while conn.poll(0):
                        if self._dispatch(conn.recv()):
                            return
                    break
                if self._dispatch(conn.recv()):
                    return
        except (EOFError, OSError):
            pass
        self._die(self._exit_reason())

    def _dispatch(self, msg: tuple) -> bool:
        """Handle one message from the engine; True when it was the last one."""
        kind = msg[0]
        if kind == "out":
            for u in msg[1]:
                self._deliver(u)
        elif kind == "reply":
            self._resolve(msg[1], msg[2])
        elif kind == "ready":
            self.info = msg[1]
            self._ready.set()
        elif kind == "failed":
            self._die(msg[1])
            return True
        return False

    def _exit_reason(self) -> str:
        # The pipe closes as the process exits; give it a moment to be reaped for its code.
        # (Another thread's is_alive() may reap it first and set the code a moment later.)
        mp_wait([self.proc.sentinel], timeout=2.0)
        deadline = time.monotonic() + 1.0
        code = self.proc.exitcode
        while code is None and time.monotonic() < deadline:
            time.sleep(0.01)
            code = self.proc.exitcode
        return describe_exit(code)

    def _die(self, message: str) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = message
            handles = list(self._handles.values())
            self._handles.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        self._ready.set()
        message = self.error
        if first and not self._closing:
            logger.error("engine: %s", message)
        for h in handles:
            post(h.loop, h.queue.put_nowait, EngineError(message))
        for loop, fut in calls:
            post(loop, _set_exception, fut, EngineError(message))
        if first and not self._closing and self.on_death is not None:
            self.on_death(message)

    def _deliver(self, u: Update) -> None:
        with self._lock:
            h = self._handles.pop(u.rid, None) if u.finished else self._handles.get(u.rid)
        if self.on_update is not None:
            self.on_update(u)
        if h is not None:
            post(h.loop, h.queue.put_nowait, u)

    def _resolve(self, call_id: int, value: Any) -> None:
        with self._lock:
            entry = self._calls.pop(call_id, None)
        if entry is not None:
            loop, fut = entry
            post(loop, _set_result, fut, value)

    # -------------------------------------------------------------- public
    def pin(self, rid: str, replica: int) -> None:
        """``routed_dp_rank`` (checked by the route against ``--dp-size``): with DP attention the
        attention group that runs ``rid``; otherwise one engine is replica 0 of itself."""
        if self.engine_kwargs.get("enable_dp_attention"):
            with self._lock:
                self._pinned[rid] = replica

    def submit(self, rid: str, input_ids: list[int], sampling_params: dict,
               priority: int | None = None, bootstrap: dict | None = None,
               cache_salt: str | None = None, lora_path: str | None = None) -> RequestHandle:
        h = RequestHandle(rid, asyncio.get_running_loop())
        with self._lock:  # checked under the lock, so a dying engine cannot miss this handle
            if self.error is not None:
                raise EngineError(self.error)
            if rid in self._handles:
                raise ValueError(f"request id {rid!r} is already in use")
            self._handles[rid] = h
        with self._lock:
            dp_rank = self._pinned.pop(rid, None)
        self._outbox.put(("add", rid, input_ids, sampling_params, priority, bootstrap, cache_salt, PEER.get(), dp_rank,
                          lora_path))
        return h

    def abort(self, rid: str) -> None:
        self._outbox.put(("abort", rid))

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    async def call(self, name: str, timeout: float | None = None, args: tuple = ()) -> Any:
        """Run one of the engine's calls (get_stats, flush_cache, check_idle, ...) with ``args``."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            if self.error is not None:
                raise EngineError(self.error)
            self._calls[call_id] = (loop, fut)
        self._outbox.put(("call", call_id, name, args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
