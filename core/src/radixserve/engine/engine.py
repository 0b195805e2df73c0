"""The offline engine: ``Engine(model=..., **server_args).generate(...)``.

``generate`` runs the scheduler in the calling thread until its requests finish. ``async_generate``
needs the caller's event loop to stay free, so it starts a background scheduler thread; once
that thread exists, ``generate`` submits to it as well. Requests submitted together are
admitted together and run in one forward batch.

On CPU each thread that runs parallel torch ops or kernels owns a pool of OpenMP workers, and
once a process holds more workers than CPUs, libgomp lets none of them spin between parallel
regions: every region then waits for its workers to wake (measured: a mixed step 18 % slower
from a background thread while the loading thread kept its pool). So the thread that built
the engine gives its workers back when the constructor returns, and so does the thread that
starts the background scheduler (:func:`radixserve.kernels.cpu.release_thread_pool`); a thread
that runs torch again simply gets a new pool. An inline ``generate`` gives its workers back
when it returns, for the same reason.

A request that fails ends with finish reason ``abort`` and a ``status_code`` (500: an error while
serving it, 429: the queue was full); its neighbours are unaffected. When the engine itself
stops (its loop died, or :meth:`Engine.shutdown`), every waiting ``generate`` call and stream
raises :class:`EngineError` instead of hanging.

With ``tp_size * pp_size > 1`` this process is rank 0 of the replica: it starts the other ranks
(:mod:`radixserve.distributed.ranks`), every forward pass is sent to them first
(:mod:`radixserve.distributed.step_sync`), and a rank that dies stops the engine the same way
(``rank_failure`` says why); :meth:`Engine.shutdown` stops the other ranks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.disaggregation.setup import attach_disaggregation
from radixserve.distributed.ranks import RanksFailed, ReplicaRanks
from radixserve.engine.calls import DEFAULT_CALL_TIMEOUT, WAIT_POLL_SECONDS, EngineError, SchedulerCalls  # noqa: F401
from radixserve.engine.expert_distribution import dump_expert_distribution_at_exit
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.request import Req
from radixserve.engine.requests import IdsT, PromptT, RequestBuilding, prompt_logprob_entries, set_bootstrap  # noqa: F401
from radixserve.engine.scheduler import EngineFailure, RequestRejected, Scheduler
from radixserve.engine.startup import check_optional_backends, check_parallel_supported
from radixserve.grammar.manager import build_grammar_manager, resolve_grammar_backend
from radixserve.hicache.build import build_prefix_cache
from radixserve.kernels import cpu as cpu_kernels
from radixserve.model_loader import load_checkpoint
from radixserve.reasoning import build_reasoning_spec
from radixserve.registry import Registry, get_registry
from radixserve.sampling import InvalidSamplingParams, SamplingParams
from radixserve.speculative.runtime import build_proposer
from radixserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

class Engine(RequestBuilding, SchedulerCalls):
    def __init__(self, model: str | None = None, *, registry: Registry | None = None, **kwargs: Any) -> None:
        self.server_args = args = ServerArgs.from_kwargs(model=model, **kwargs)
        logging.basicConfig(level=args.log_level.upper())
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.registry = registry or get_registry()
        check_parallel_supported(args)
        # Fail fast, before loading the model, naming the flag that chose each backend.
        self.registry.resolve("attention", args.prefill_backend_name, flag=args.backend_flag("prefill"))
        self.registry.resolve("attention", args.decode_backend_name, flag=args.backend_flag("decode"))
        check_optional_backends(args, self.registry)
        if args.speculative_algorithm is not None:
            self.registry.resolve("speculative", args.speculative_algorithm.lower(), flag="--speculative-algorithm")
        grammar_entry = resolve_grammar_backend(args, self.registry)
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._inline_lock = threading.Lock()  # one caller at a time steps the scheduler inline
        self._inflight: dict[int, Req] = {}  # submitted and not yet finished, by id()
        self._inflight_lock = threading.Lock()
        self._closed = False
        self.rank_failure: str | None = None  # why a rank of a multi-rank replica died
        self.on_rank_failure: Callable[[str], None] | None = None  # called after the engine marked it
        # --tp-size N: this process is rank 0; the other ranks start now and join it
        self.ranks = ReplicaRanks(args, self._rank_failed) if args.world_size > 1 else None
        try:
            self._init_rank0(args, grammar_entry)
        except BaseException as e:
            if self.ranks is None:
                raise
            # rank 0's own error about the flags or files stands (the followers fail the same way);
            # anything else here is likely a collective that failed because a follower died
            own = isinstance(e, (ValueError, OSError))
            failure = None if own else self.ranks.failure or self.ranks.dead_rank()
            self.ranks.shutdown()
            if failure is not None:
                raise RanksFailed(f"the engine could not start: {failure} (see its log above)") from e
            raise
        self._seed_counter = itertools.count()
        self._release_thread_pool()  # loading is done: whichever thread steps the engine keeps the only pool

    def _init_rank0(self, args: ServerArgs, grammar_entry) -> None:
        ckpt = load_checkpoint(args.model, self.registry)
        self.checkpoint = ckpt
        # defaults for the sampling fields a request leaves out: the checkpoint's
        # generation_config.json (--sampling-defaults model), then --preferred-sampling-params
        self.sampling_defaults: dict[str, Any] = {
            **(ckpt.generation_defaults if args.sampling_defaults == "model" else {}),
            **args.preferred_sampling_dict()}
        self.tokenizer = load_tokenizer(args.tokenizer_path or ckpt.tokenizer_dir,
                                        None if args.tokenizer_path else ckpt.gguf_file, args.chat_template)
        self.model_config = ckpt.config
        self.reasoning = build_reasoning_spec(args.reasoning_parser, self.tokenizer.hf)  # before the slow part
        self.runner = ModelRunner(args, ckpt, self.registry)
        if self.ranks is not None:
            self.ranks.attach(self.runner)
        eos = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        grammar = build_grammar_manager(args, grammar_entry, self.tokenizer.hf, ckpt.config.vocab_size, eos)
        proposer = build_proposer(args, self.registry, self.runner, self.tokenizer.hf, eos)
        cache = build_prefix_cache(args, self.runner, self.registry, ckpt.path)  # HiCache, or None
        self.scheduler = Scheduler(self.runner, self.tokenizer, eos, grammar, proposer, cache,
                                   reasoning=self.reasoning)
        if args.disaggregation_mode != "null":  # the prefill or the decode side of disaggregated requests
            attach_disaggregation(self.scheduler, args, self.registry, self.runner)
        self.runner.init_cuda_graphs()  # last: the proposer may have set the hidden layers decode keeps

    # ------------------------------------------------------------ requests
    # ------------------------------------------------------------ ranks
    def _rank_failed(self, reason: str) -> None:
        """A rank died or lost step (called from a watcher thread): the engine stops; every
        waiting call raises EngineError, later forward steps raise at once."""
        message = f"a rank of this multi-rank engine failed: {reason}"
        self.rank_failure = message
        if self._error is None:
            self._error = EngineError(message)
        self._stopped.set()
        self._fail_inflight(message)
        if self.on_rank_failure is not None:
            self.on_rank_failure(message)

    # ------------------------------------------------------------ loop
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineError(f"the engine loop died: {self._error!r}") from self._error
        if self._closed:
            raise EngineError("the engine was shut down")

    def _release_thread_pool(self) -> None:
        """The calling thread's OpenMP workers given back (CPU only; see the module docstring)."""
        if self.runner.device.type == "cpu":
            cpu_kernels.release_thread_pool()

    def _ensure_loop(self) -> None:
        self._check_alive()
        if self._thread is None or not self._thread.is_alive():
            self._release_thread_pool()  # this thread may have stepped the engine inline until now
            self._stopped.clear()
            self._thread = threading.Thread(target=self._loop, name="radixserve-scheduler", daemon=True)
            self._thread.start()

    def _drain_inbox(self, block: bool) -> None:
        """Apply queued submissions and aborts (waiting up to 50 ms for one if ``block``)."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                for req in payload:
                    self.scheduler.add_request(req)
            elif kind == "abort":
                self.scheduler.abort(payload)
            elif kind == "call":  # run a function on the scheduler's thread
                fn, box, done = payload
                try:
                    box.append((True, fn()))
                except Exception as e:  # noqa: BLE001 - the caller raises it, the loop goes on
                    box.append((False, e))
                finally:
                    done.set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        sched = self.scheduler
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not sched.has_work)
                while sched.has_work and self._inbox.empty() and not self._stopped.is_set():
                    sched.step()
        except BaseException as e:  # surface to callers instead of hanging them
            logger.exception("scheduler loop failed")
            self._error = e
            self._fail_inflight(f"the engine loop died: {type(e).__name__}: {e}")

    def _track(self, reqs: list[Req]) -> None:
        """Remember ``reqs`` until they finish, so a dying engine can fail them."""
        for req in reqs:
            callback = req.on_output

            def on_output(r: Req, n: int, finished: bool, callback=callback) -> None:
                if finished:
                    with self._inflight_lock:
                        self._inflight.pop(id(r), None)
                if callback is not None:
                    callback(r, n, finished)

            req.on_output = on_output
        with self._inflight_lock:
            self._inflight.update((id(r), r) for r in reqs)

    def _fail_inflight(self, message: str) -> None:
        """Finish every tracked request with a 503 and wake its caller."""
        with self._inflight_lock:
            reqs = list(self._inflight.values())
            self._inflight.clear()
        for req in reqs:
            if req.finished:
                continue
            req.finish_reason = {"type": "abort", "status_code": 503, "message": message}
            try:
                req.on_output(req, 0, True)
            except Exception:  # noqa: BLE001 - e.g. the caller's event loop is gone
                logger.debug("request %s: could not report the engine's stop", req.rid, exc_info=True)

    def _submit(self, reqs: list[Req]) -> None:
        with self._inline_lock:  # wait for an inline generate to hand the scheduler over
            self._ensure_loop()
            self._track(reqs)
        self._inbox.put(("add", reqs))

    # ------------------------------------------------------------ public
    def generate(self, prompt: PromptT = None, sampling_params: dict | SamplingParams | list | None = None,
                 input_ids: IdsT = None, priority: int | list[int] | None = None,
                 cache_salt: str | None = None, bootstrap_host: str | None = None, bootstrap_port: int | None = None,
                 bootstrap_room: int | None = None, lora_path: str | list | None = None) -> dict[str, Any] | list[dict]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts).

        With ``n > 1`` a prompt yields ``n`` outputs, flattened in prompt order. ``priority``
        (one for all prompts, or one per prompt) takes effect with ``enable_priority_scheduling``:
        lower values are served first. ``cache_salt``: the prefix-cache namespace of these
        requests (they share cached prefixes only with requests of the same salt); None shares
        the common one. ``bootstrap_*``: prefill-decode disaggregation (one prompt), as SGLang's.
        ``lora_path``: a loaded LoRA adapter's name, or one name (or None) per prompt."""
        ids, params, single = self.normalize(prompt, input_ids, sampling_params)
        groups = self.make_requests(ids, params, priorities=self._priorities(priority, len(ids)),
                                    cache_salt=cache_salt, lora_path=lora_path)
        reqs = [r for g in groups for r in g]
        set_bootstrap(reqs, bootstrap_host, bootstrap_port, bootstrap_room)
        done = threading.Semaphore(0)

        def on_output(req: Req, n: int, finished: bool) -> None:
            if finished:
                done.release()

        for r in reqs:
            r.on_output = on_output
        # (disaggregated: the scheduler's loop must go on after these finish, to send their KV)
        if self._thread is None and self.scheduler.disagg is None and self._inline_lock.acquire(blocking=False):
            try:
                self._run_inline(reqs)
            finally:
                self._release_thread_pool()  # a scheduler thread started later keeps the only pool
                self._inline_lock.release()
            return self._collect(reqs, single)
        self._submit(reqs)
        for _ in reqs:
            while not done.acquire(timeout=WAIT_POLL_SECONDS):
                self._check_alive()
        self._raise_if_stopped(reqs)
        return self._collect(reqs, single)

    def _raise_if_stopped(self, reqs: list[Req]) -> None:
        """Raise EngineError if the engine stopped before all of ``reqs`` finished."""
        if self._error is None and not self._closed:
            return
        for r in reqs:
            reason = r.finish_reason or {}
            if reason.get("status_code") == 503:
                raise EngineError(reason.get("message", "the engine stopped"))

    def _run_inline(self, reqs: list[Req]) -> None:
        self._check_alive()
        sched = self.scheduler
        for r in reqs:
            sched.add_request(r)
        try:
            while not all(r.finished for r in reqs):
                self._drain_inbox(block=False)  # aborts from other threads
                sched.step()
                if self.rank_failure is not None:  # a multi-rank replica lost a rank
                    raise EngineFailure(self.rank_failure)
        except BaseException as e:
            for r in reqs:  # leave nothing half-run behind
                if not r.finished:
                    sched.abort(r.rid)
            if isinstance(e, EngineFailure):  # the engine cannot go on
                self._error = e
                sched.abort_all({"type": "abort", "status_code": 503, "message": f"the engine stopped: {e}"})
                raise EngineError(f"the engine stopped: {e}") from e
            raise

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | SamplingParams | None = None,
                             input_ids: list[int] | None = None, stream: bool = False, priority: int | None = None,
                             cache_salt: str | None = None):
        """Generate for one prompt. With ``stream=True`` returns an async iterator of chunks,
        each with the new ``text``/``output_ids`` since the last chunk and, on the last one,
        ``meta_info.finish_reason``; otherwise returns the final output dict. ``priority`` and
        ``cache_salt`` as :meth:`generate`'s."""
        if stream:
            return self._stream(prompt, sampling_params, input_ids, priority=priority, cache_salt=cache_salt)
        final = None
        async for chunk in self._stream(prompt, sampling_params, input_ids, cumulative=True, priority=priority,
                                        cache_salt=cache_salt):
            final = chunk
        return final

    async def _stream(self, prompt, sampling_params, input_ids, cumulative: bool = False,
                      priority: int | None = None, cache_salt: str | None = None) -> AsyncIterator[dict]:
        if isinstance(prompt, list) or (input_ids and not isinstance(input_ids[0], int)):
            raise ValueError("async_generate takes a single prompt")
        ids, params, _ = self.normalize(prompt, input_ids, sampling_params)
        if params[0].n != 1:
            raise ValueError("async_generate streams one sequence; use n=1")
        (req,), = self.make_requests(ids, params, priorities=self._priorities(priority, 1), cache_salt=cache_salt)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req.on_output = lambda r, n, finished: loop.call_soon_threadsafe(q.put_nowait, (len(r.output_ids), finished))
        self._submit([req])
        sent_ids, sent_text = 0, ""
        try:
            while True:
                _, finished = await q.get()
                if not finished and not q.empty():
                    continue  # coalesce: send everything available at once
                if finished:
                    self._raise_if_stopped([req])
                    out = self._output(req)
                    text = out["text"]
                else:
                    text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
                    if text.endswith("\ufffd"):
                        continue  # an incomplete multi-byte character; wait for more tokens
                    out = None
                ids_now = list(req.output_ids)
                chunk = {
                    "text": text if cumulative else text[len(sent_text):],
                    "output_ids": ids_now if cumulative else ids_now[sent_ids:],
                    "meta_info": out["meta_info"] if out else {"id": req.rid, "finish_reason": None},
                }
                sent_ids, sent_text = len(ids_now), text
                yield chunk
                if finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        """Abort a request by id (queued, prefilling or decoding); its caller receives
        finish reason ``abort`` with the tokens produced so far."""
        self._inbox.put(("abort", rid))

    def get_stats(self) -> dict[str, Any]:
        """Running/waiting requests, pool usage, cache hits, throughput, retractions."""
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Stop the scheduler; requests still queued, compiling or running end with a 503
        and their waiting callers raise EngineError."""
        self._stopped.set()
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=10)
        message = "the engine was shut down"
        if (thread is None or not thread.is_alive()) and self._inline_lock.acquire(timeout=10):
            try:  # nothing steps the scheduler now: free what its requests hold
                self._drain_inbox(block=False)
                self.scheduler.abort_all({"type": "abort", "status_code": 503, "message": message})
            except Exception:  # noqa: BLE001 - a dead loop may have left it inconsistent
                logger.exception("could not release the requests of a stopped engine")
            try:
                dump_expert_distribution_at_exit(self.scheduler)
            except Exception:  # noqa: BLE001
                logger.exception("could not write the expert distribution record")
            try:
                self.scheduler.close()  # HiCache's writes land, threads stop; grammar processes end
            except Exception:  # noqa: BLE001
                logger.exception("could not close the prefix cache or the grammar compilers")
            finally:
                self._inline_lock.release()
        if self.ranks is not None:  # the other ranks leave (or are killed if stuck)
            self.ranks.shutdown()
        self._fail_inflight(message)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def check_idle_invariant(self) -> None:
        """Raise if, with no work queued, any KV page or request slot is still held."""
        self.scheduler.check_idle_invariant()


__all__ = ["Engine", "EngineError", "InvalidSamplingParams", "RequestRejected"]
