"""The HTTP process's side of the engine: start the engine process, submit, stream, abort.

Pipe writes happen on a writer thread and reads on a reader thread, so the event loop
never blocks on the engine; updates reach each request's asyncio queue through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from typing import Any

from radixserve_server.engine_proc import Update, engine_main

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine process failed to start or died."""


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
                raise item
            if item.finished:
                self.finished = True
            yield item
            if item.finished:
                return


class EngineClient:
    def __init__(self, engine_kwargs: dict) -> None:
        self.engine_kwargs = engine_kwargs
        self.info: dict[str, Any] | None = None
        self.error: str | None = None
        self._ready = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.proc: mp.process.BaseProcess | None = None
        self.on_update: Callable[[Update], None] | None = None  # metrics hook (reader thread)
        self._closing = False

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=engine_main, args=(self.engine_kwargs, to_engine_r, from_engine_w),
                                name="radixserve-engine", daemon=True)
        self.proc.start()
        to_engine_r.close()
        from_engine_w.close()
        self._send_conn, self._recv_conn = to_engine_w, from_engine_r
        threading.Thread(target=self._reader, name="radixserve-engine-reader", daemon=True).start()
        threading.Thread(target=self._writer, name="radixserve-engine-writer", daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> dict:
        if not self._ready.wait(timeout):
            raise EngineError("the engine did not start in time")
        if self.error is not None:
            raise EngineError(self.error)
        return self.info

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive() and self.error is None

    def shutdown(self, timeout: float = 10.0) -> int | None:
        """Stop the engine process; returns its exit code (0: clean, with no KV page leaked)."""
        if self.proc is None:
            return None
        self._closing = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return self.proc.exitcode

    # ------------------------------------------------------------- threads
    def _writer(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._send_conn.send(msg)
            except (BrokenPipeError, OSError):
                return

    def _reader(self) -> None:
        try:
            while True:
                msg = self._recv_conn.recv()
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
                    return
        except (EOFError, OSError):
            self._die("the engine process exited")

    def _die(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self._ready.set()
        if not self._closing:
            logger.error("engine: %s", message)
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        for h in handles:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, EngineError(message))
        for loop, fut in calls:
            loop.call_soon_threadsafe(_set_exception, fut, EngineError(message))

    def _deliver(self, u: Update) -> None:
        with self._lock:
            h = self._handles.pop(u.rid, None) if u.finished else self._handles.get(u.rid)
        if self.on_update is not None:
            self.on_update(u)
        if h is not None:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, u)

    def _resolve(self, call_id: int, value: Any) -> None:
        with self._lock:
            entry = self._calls.pop(call_id, None)
        if entry is not None:
            loop, fut = entry
            loop.call_soon_threadsafe(_set_result, fut, value)

    # -------------------------------------------------------------- public
    def submit(self, rid: str, input_ids: list[int], sampling_params: dict) -> RequestHandle:
        if self.error is not None:
            raise EngineError(self.error)
        h = RequestHandle(rid, asyncio.get_running_loop())
        with self._lock:
            if rid in self._handles:
                raise ValueError(f"request id {rid!r} is already in use")
            self._handles[rid] = h
        self._outbox.put(("add", rid, input_ids, sampling_params))
        return h

    def abort(self, rid: str) -> None:
        self._outbox.put(("abort", rid))

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    async def call(self, name: str, timeout: float | None = None) -> Any:
        """Run one of the engine's calls (get_stats, flush_cache, check_idle)."""
        if self.error is not None:
            raise EngineError(self.error)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (loop, fut)
        self._outbox.put(("call", call_id, name))
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
