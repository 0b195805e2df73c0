"""Compiling grammars off the scheduler's path: compile workers, a cache and a time limit.

The scheduler asks :meth:`GrammarManager.get` for a request's ``(kind, text)`` and gets a
:class:`CompileJob` at once; the compile runs on a compile thread while the scheduler keeps
stepping other requests. Jobs are cached by ``(kind, text)``: successes and failures alike
(a second request with a broken grammar fails without compiling). A job that runs past
``--grammar-compile-timeout`` seconds fails its requests; if it had started compiling, the
failure is cached too.

Where the backend can move compiled grammars between processes (both shipped backends can),
each compile thread drives a worker process (:mod:`radixserve.grammar.workers`) and a
timed-out compile is stopped by killing its process; the thread goes on with a fresh one.
Processes start with the first compile; waiting for one to boot (seconds: the first
grammar after start-up) is not counted against the time limit.
Otherwise the backend compiles on the thread itself, which cannot be stopped: the worker
stuck in that compile is written off and a new worker takes its place (at most
``MAX_ABANDONED_WORKERS`` stuck threads exist at once; past that, jobs wait for one).

Admission bounds: a client (the ``client`` given to :meth:`GrammarManager.get`: the HTTP
peer's address) has at most ``--grammar-max-compiles-per-client`` compiles queued or
running; its further compiles wait for their turn, beside the queue (the time limit still
counts from their arrival), so one client never holds more workers than that. Past
``MAX_HELD_PER_CLIENT`` waiting for one client, or ``MAX_PENDING_JOBS`` waiting in all,
compiles are refused at once (status 429). Joining a compile that is cached or already
running costs nothing and counts for nobody. JSON constraints compile bounded (:mod:`radixserve.grammar.bounds`); the
cache is keyed by the request's own ``(kind, text)``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Any

from radixserve.grammar import GrammarBackend, GrammarError
from radixserve.grammar.bounds import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STRING_LENGTH, bound_constraint
from radixserve.grammar.workers import COMPILED, INVALID, CompileProcess, ProcessPool

logger = logging.getLogger(__name__)

DEFAULT_NUM_WORKERS = 2
DEFAULT_CACHE_SIZE = 1024  # compiled grammars kept (LRU); failures count too
DEFAULT_MAX_COMPILES_PER_CLIENT = 1  # --grammar-max-compiles-per-client
MAX_PENDING_JOBS = 256  # compiles waiting for a worker or their client's turn; more are refused
MAX_HELD_PER_CLIENT = 64  # compiles one client may have waiting for its turn; more are refused
MAX_BOOT_SECONDS = 120.0  # a compile process that takes longer to start fails its job
MAX_ABANDONED_WORKERS = 8  # thread mode: workers stuck in timed-out compiles, replaced meanwhile


class CompileJob:
    """One ``(kind, text)`` compile: pending, then ``compiled`` or ``error`` (a message)."""

    def __init__(self, key: tuple[str, str], client: str | None = None) -> None:
        self.key = key
        self.client = client  # whose request caused the compile (None: not counted)
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.allowance = 0.0  # seconds beyond the time limit: waiting for a compile process to boot
        self.compiled: Any = None
        self.error: str | None = None
        self.status_code = 400  # of the requests' finish reason when ``error`` is set
        self.done = threading.Event()
        self.num_hits = 0  # requests served from the cache after the first
        self.worker: threading.Thread | None = None  # compiling it, once started
        self.process: CompileProcess | None = None  # process mode: the process compiling it
        self.on_done = None  # called once with the job when it gets its outcome
        self.active = False  # queued or compiling (not held behind its client's other compiles)
        self._finished = False
        self._lock = threading.Lock()

    @property
    def is_done(self) -> bool:
        return self.done.is_set()

    def _finish(self, compiled: Any = None, error: str | None = None, status_code: int = 400) -> bool:
        """Record the outcome once; False if another thread finished it first (the worker
        and the time limit race: the first outcome wins, atomically)."""
        with self._lock:
            if self._finished:
                return False
            self._finished = True
            self.compiled, self.error, self.status_code = compiled, error, status_code
        if self.on_done is not None:  # before waiters wake: they see its effects
            self.on_done(self)
        self.done.set()
        return True


class GrammarManager:
    """Compile workers, the compiled-grammar cache and the compile time limit."""

    def __init__(self, backend: GrammarBackend, *, compile_timeout: float,
                 num_workers: int = DEFAULT_NUM_WORKERS,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 json_max_string_length: int = DEFAULT_MAX_STRING_LENGTH,
                 json_max_items: int = DEFAULT_MAX_ITEMS,
                 max_compiles_per_client: int = DEFAULT_MAX_COMPILES_PER_CLIENT) -> None:
        self.backend = backend
        self.json_bounds = (json_max_string_length, json_max_items)  # see radixserve.grammar.bounds
        self.compile_timeout = compile_timeout
        self.num_workers = num_workers
        self.cache_size = cache_size
        self.max_compiles_per_client = max_compiles_per_client  # 0: no limit
        # process mode: compiles run in worker processes, killed at the time limit
        self.processes = (ProcessPool(backend, self.json_bounds, num_workers)
                          if getattr(backend, "compiles_in_processes", False) else None)
        self._cache: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: queue.Queue[CompileJob] = queue.Queue()
        self._workers: set[threading.Thread] = set()  # live workers
        self._abandoned: set[threading.Thread] = set()  # thread mode: stuck in a timed-out compile
        self._active: Counter[str] = Counter()  # by client: compiles queued or running
        self._held: dict[str, deque[CompileJob]] = {}  # by client: compiles waiting for its turn
        self._worker_ids = 0
        self._lock = threading.Lock()
        self.num_rejected = 0
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_killed = 0

    # ------------------------------------------------------------ requests
    def get(self, key: tuple[str, str], client: str | None = None) -> CompileJob:
        """The job for ``key``: cached (done or still compiling) or newly queued.

        ``client`` identifies the requester for ``max_compiles_per_client`` (None: the
        engine's own callers, not limited)."""
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                job.num_hits += 1
                self.num_cache_hits += 1
                return job
            job = CompileJob(key, client)
            refusal = self._refusal(client)
            if refusal is not None:  # refused, and not cached
                self.num_rejected += 1
                job._finish(error=refusal, status_code=429)
                return job
            self._cache[key] = job
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiles += 1
            if client is not None:
                job.on_done = self._client_done
                limit = self.max_compiles_per_client
                if limit and self._active[client] >= limit:  # waits for the client's own compiles
                    self._held.setdefault(client, deque()).append(job)
                    return job
                self._active[client] += 1
                job.active = True
        self._start_workers()
        self._queue.put(job)
        return job

    def _refusal(self, client: str | None) -> str | None:
        if self._queue.qsize() + sum(map(len, self._held.values())) >= MAX_PENDING_JOBS:
            return f"too many grammars are waiting to compile ({MAX_PENDING_JOBS}); retry later"
        held = len(self._held.get(client, ()))
        if client is not None and held >= MAX_HELD_PER_CLIENT:
            return (f"this client already has {held} grammars waiting to compile behind its "
                    f"{self._active[client]} compiling (--grammar-max-compiles-per-client "
                    f"{self.max_compiles_per_client}); retry once they end")
        return None

    def _client_done(self, job: CompileJob) -> None:
        """A client's compile ended: its next held compile (if any) takes its place."""
        client, released, expired = job.client, None, []
        now = time.monotonic()
        with self._lock:
            held = self._held.get(client, deque())
            if not job.active:  # timed out while held
                if job in held:
                    held.remove(job)
            else:
                self._active[client] -= 1
                while held and released is None:
                    nxt = held.popleft()
                    if nxt._finished:  # (set before this callback runs, unlike ``done``)
                        continue
                    if now - nxt.submitted > self.compile_timeout:  # out of time: never started
                        expired.append(nxt)
                        continue
                    released = nxt
                    nxt.active = True
                    self._active[client] += 1
                if not self._active[client]:
                    del self._active[client]
            if not held:
                self._held.pop(client, None)
        for late in expired:
            self.check_timeout(late, now)
        if released is not None:
            self._queue.put(released)

    def check_timeout(self, job: CompileJob, now: float | None = None) -> None:
        """Fail ``job`` if it has waited longer than the compile time limit; a compile
        still running in a worker process is stopped by killing the process."""
        if job.is_done:
            return
        now = time.monotonic() if now is None else now
        if now - job.submitted <= self.compile_timeout + job.allowance:
            return
        if job._finish(error=f"grammar compilation timed out after {self.compile_timeout:g} s "
                             f"(--grammar-compile-timeout)"):
            logger.warning("grammar %s compile timed out", job.key[0])
            with self._lock:
                worker, process = job.worker, job.process
                # never compiled: queued behind others, or taken by a worker that had no process to hand
                # it yet (it will not start it now): do not cache the failure
                if worker is None or (self.processes is not None and process is None):
                    if self._cache.get(job.key) is job:
                        del self._cache[job.key]
                elif self.processes is not None:  # its thread reaps the process, goes on with a fresh one
                    self.num_killed += 1
                    process.kill()
                elif worker in self._workers:  # thread mode, stuck: a new worker takes its place
                    self._workers.discard(worker)
                    self._abandoned.add(worker)
            self._start_workers()

    def wait_any(self, jobs: list[CompileJob], timeout: float) -> None:
        """Block up to ``timeout`` seconds or until one of ``jobs`` is done (or times out)."""
        deadline = time.monotonic() + timeout
        for job in jobs:
            limit = job.submitted + self.compile_timeout
            deadline = min(deadline, max(limit, time.monotonic()))
        # Events cannot be waited on together; poll the first, briefly, then the rest.
        while True:
            if any(j.is_done for j in jobs):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            jobs[0].done.wait(min(left, 0.005))

    def stats(self) -> dict[str, int]:
        return {"num_grammar_compiles": self.num_compiles,
                "num_grammar_cache_hits": self.num_cache_hits,
                "num_grammar_compiles_refused": self.num_rejected,
                "num_grammar_compiles_killed": self.num_killed,
                "num_grammar_workers_stuck": len(self._abandoned)}

    def close(self) -> None:
        """Kill the worker processes (process mode); compiles still queued never start."""
        if self.processes is not None:
            self.processes.close()

    # ------------------------------------------------------------- workers
    def _start_workers(self) -> None:
        with self._lock:
            while (len(self._workers) < self.num_workers
                   and len(self._workers) + len(self._abandoned) < self.num_workers + MAX_ABANDONED_WORKERS):
                self._worker_ids += 1
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"radixserve-grammar-{self._worker_ids}")
                self._workers.add(t)
                t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        process: CompileProcess | None = None
        while True:
            job = self._queue.get()
            with self._lock:
                if job.is_done:  # timed out while queued
                    continue
                job.started = time.monotonic()
                job.worker = me
            if self.processes is None:
                self._compile_here(job)
            else:
                process = self._compile_in(process, job)
            with self._lock:
                if me in self._abandoned:  # replaced while stuck: leave
                    self._abandoned.discard(me)
                    break
        self._start_workers()  # a slot for a live worker may have opened

    def _compile_here(self, job: CompileJob) -> None:
        """Thread mode: the backend compiles on this thread."""
        try:
            compiled = self.backend.compile(*bound_constraint(*job.key, *self.json_bounds))
        except GrammarError as e:
            job._finish(error=str(e) or "the grammar is invalid")
        except Exception as e:  # a backend bug must still fail only this request
            logger.exception("grammar backend %s failed compiling a %s grammar",
                             self.backend.name, job.key[0])
            job._finish(error=f"{type(e).__name__}: {e}")
        else:
            job._finish(compiled=compiled)

    @staticmethod
    def _wait_ready(process: CompileProcess, job: CompileJob) -> bool:
        """Wait for ``process`` to boot; the time that takes is not counted against ``job``
        (up to MAX_BOOT_SECONDS)."""
        if process.ready is not None:
            return process.ready
        start = time.monotonic()
        job.allowance = MAX_BOOT_SECONDS
        ready = process.wait_ready()
        job.allowance = time.monotonic() - start
        return ready

    def _compile_in(self, process: CompileProcess | None, job: CompileJob) -> CompileProcess | None:
        """Process mode: compile ``job`` in ``process`` (or a fresh one); the process to use
        next, None when this one is gone (killed at the time limit, or crashed)."""
        try:
            process = process or self.processes.take()
        except RuntimeError as e:  # closed: the engine is shutting down
            job._finish(error=str(e), status_code=503)
            return None
        with self._lock:  # (check_timeout kills only a process handed over before the job ended)
            handed = not job.is_done
            if handed:
                job.process = process
        if not handed:  # timed out before the process was handed to it: it never ran this compile
            self.processes.release(process)
            return None
        result = process.compile(*job.key) if self._wait_ready(process, job) else None
        if result is None:
            code = self.processes.release(process)
            if job._finish(error=f"the grammar compile process exited with code {code}", status_code=500):
                logger.error("grammar backend %s: compile process %d exited with code %s compiling a %s "
                             "grammar", self.backend.name, process.pid, code, job.key[0])
            return None
        status, payload = result
        if status == COMPILED:
            try:
                job._finish(compiled=self.backend.deserialize(payload))
            except Exception as e:  # noqa: BLE001 - fails only this grammar's requests
                logger.exception("grammar backend %s could not load a compiled grammar", self.backend.name)
                job._finish(error=f"{type(e).__name__}: {e}", status_code=500)
        elif status == INVALID:
            job._finish(error=payload.decode(errors="replace"))
        else:
            logger.error("grammar backend %s failed compiling a %s grammar: %s", self.backend.name,
                         job.key[0], payload.decode(errors="replace"))
            job._finish(error=payload.decode(errors="replace"))
        return process


# ------------------------------------------------------------------ start-up
DEFAULT_GRAMMAR_BACKEND = "xgrammar"
NO_GRAMMAR_BACKEND = "none"


def resolve_grammar_backend(args, registry):
    """The registry entry chosen by ``--grammar-backend``, or None for no backend.

    Unset means ``xgrammar`` when it is installed and usable here, else none; ``none``
    turns structured output off; any other name must be installed and available."""
    name = args.grammar_backend
    if name is None:
        entry = registry.entries["grammar"].get(DEFAULT_GRAMMAR_BACKEND)
        if entry is not None and entry.is_available:
            return entry
        return None
    if name == NO_GRAMMAR_BACKEND:
        return None
    return registry.resolve("grammar", name, flag="--grammar-backend")


def build_grammar_manager(args, entry, hf_tokenizer, vocab_size: int,
                          eos_token_ids) -> GrammarManager | None:
    """Build the chosen backend once (``entry`` from :func:`resolve_grammar_backend`)."""
    if entry is None:
        return None
    backend = entry.factory(tokenizer=hf_tokenizer, vocab_size=vocab_size,
                            eos_token_ids=sorted(eos_token_ids))
    if not isinstance(backend, GrammarBackend):
        raise TypeError(f"--grammar-backend {entry.name}: the factory from {entry.distribution} "
                        f"returned {type(backend).__name__}, not a radixserve.grammar.GrammarBackend")
    backend.name = backend.name or entry.name
    return GrammarManager(backend, compile_timeout=args.grammar_compile_timeout,
                          json_max_string_length=args.constrained_json_max_string_length,
                          json_max_items=args.constrained_json_max_items,
                          max_compiles_per_client=args.grammar_max_compiles_per_client)


def no_backend_message(args) -> str:
    if args.grammar_backend == NO_GRAMMAR_BACKEND:
        return ("structured output (json_schema, regex, ebnf, response_format) is off: the "
                "engine runs with --grammar-backend none; restart it with --grammar-backend "
                "xgrammar or llguidance")
    return ("structured output (json_schema, regex, ebnf, response_format) needs a grammar "
            "backend and none is installed: pip install radixserve-grammar-xgrammar (or "
            "radixserve-grammar-llguidance) and pass --grammar-backend")
