"""Compiling grammars off the scheduler's path: worker threads, a cache and a time limit.

The scheduler asks :meth:`GrammarManager.get` for a request's ``(kind, text)`` and gets a
:class:`CompileJob` at once; the compile runs on a daemon worker thread while the
scheduler keeps stepping other requests. Jobs are cached by ``(kind, text)``: successes
and failures alike (a second request with a broken grammar fails without compiling).
A job that runs past ``--grammar-compile-timeout`` seconds fails its requests; if it had
started compiling, the failure is cached too. A thread cannot be stopped, so the worker
stuck in that compile is written off and a new worker takes its place: slow grammars
never starve the pool (at most ``MAX_ABANDONED_WORKERS`` stuck threads exist at once;
past that, jobs wait for one to come back). At most ``MAX_PENDING_JOBS`` compiles wait in
the queue; more are refused at once (status 429) rather than queued without bound.
JSON constraints compile bounded (:mod:`radixserve.grammar.bounds`); the cache is keyed
by the request's own ``(kind, text)``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

from radixserve.grammar import GrammarBackend, GrammarError
from radixserve.grammar.bounds import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STRING_LENGTH, bound_constraint

logger = logging.getLogger(__name__)

DEFAULT_NUM_WORKERS = 2
DEFAULT_CACHE_SIZE = 1024  # compiled grammars kept (LRU); failures count too
MAX_PENDING_JOBS = 256  # compiles waiting for a worker; more are refused
MAX_ABANDONED_WORKERS = 8  # workers stuck in timed-out compiles, replaced meanwhile


class CompileJob:
    """One ``(kind, text)`` compile: pending, then ``compiled`` or ``error`` (a message)."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.compiled: Any = None
        self.error: str | None = None
        self.status_code = 400  # of the requests' finish reason when ``error`` is set
        self.done = threading.Event()
        self.num_hits = 0  # requests served from the cache after the first
        self.worker: threading.Thread | None = None  # compiling it, once started
        self._lock = threading.Lock()

    @property
    def is_done(self) -> bool:
        return self.done.is_set()

    def _finish(self, compiled: Any = None, error: str | None = None, status_code: int = 400) -> bool:
        """Record the outcome once; False if another thread finished it first (the worker
        and the time limit race: the first outcome wins, atomically)."""
        with self._lock:
            if self.done.is_set():
                return False
            self.compiled, self.error, self.status_code = compiled, error, status_code
            self.done.set()
            return True


class GrammarManager:
    """Compile worker threads, the compiled-grammar cache and the compile time limit."""

    def __init__(self, backend: GrammarBackend, *, compile_timeout: float,
                 num_workers: int = DEFAULT_NUM_WORKERS,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 json_max_string_length: int = DEFAULT_MAX_STRING_LENGTH,
                 json_max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.backend = backend
        self.json_bounds = (json_max_string_length, json_max_items)  # see radixserve.grammar.bounds
        self.compile_timeout = compile_timeout
        self.num_workers = num_workers
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self._queue: queue.Queue[CompileJob] = queue.Queue()
        self._workers: set[threading.Thread] = set()  # live workers
        self._abandoned: set[threading.Thread] = set()  # stuck in a timed-out compile
        self._worker_ids = 0
        self._lock = threading.Lock()
        self.num_rejected = 0
        self.num_compiles = 0
        self.num_cache_hits = 0

    # ------------------------------------------------------------ requests
    def get(self, key: tuple[str, str]) -> CompileJob:
        """The job for ``key``: cached (done or still compiling) or newly queued."""
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                job.num_hits += 1
                self.num_cache_hits += 1
                return job
            job = CompileJob(key)
            if self._queue.qsize() >= MAX_PENDING_JOBS:  # refused, and not cached
                self.num_rejected += 1
                job._finish(error=f"too many grammars are waiting to compile ({MAX_PENDING_JOBS}); "
                                  "retry later", status_code=429)
                return job
            self._cache[key] = job
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiles += 1
        self._start_workers()
        self._queue.put(job)
        return job

    def check_timeout(self, job: CompileJob, now: float | None = None) -> None:
        """Fail ``job`` if it has waited longer than the compile time limit."""
        if job.is_done:
            return
        now = time.monotonic() if now is None else now
        if now - job.submitted <= self.compile_timeout:
            return
        if job._finish(error=f"grammar compilation timed out after {self.compile_timeout:g} s "
                             f"(--grammar-compile-timeout)"):
            logger.warning("grammar %s compile timed out", job.key[0])
            with self._lock:
                worker = job.worker
                if worker is None:  # never compiled (queued behind others): do not cache the failure
                    if self._cache.get(job.key) is job:
                        del self._cache[job.key]
                elif worker in self._workers:  # stuck: write it off, a new worker takes its place
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
                "num_grammar_workers_stuck": len(self._abandoned)}

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
        while True:
            job = self._queue.get()
            with self._lock:
                if job.is_done:  # timed out while queued
                    continue
                job.started = time.monotonic()
                job.worker = me
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
            with self._lock:
                if me in self._abandoned:  # replaced while stuck: leave
                    self._abandoned.discard(me)
                    break
        self._start_workers()  # a slot for a live worker may have opened


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
                          json_max_items=args.constrained_json_max_items)


def no_backend_message(args) -> str:
    if args.grammar_backend == NO_GRAMMAR_BACKEND:
        return ("structured output (json_schema, regex, ebnf, response_format) is off: the "
                "engine runs with --grammar-backend none; restart it with --grammar-backend "
                "xgrammar or llguidance")
    return ("structured output (json_schema, regex, ebnf, response_format) needs a grammar "
            "backend and none is installed: pip install radixserve-grammar-xgrammar (or "
            "radixserve-grammar-llguidance) and pass --grammar-backend")
