"""The engine process: loads the model and runs the scheduler on its main thread.

It talks to the HTTP process over two pipes of pickled tuples. Prompts arrive already
tokenised and outputs leave as token ids; text work stays in the HTTP process (the
scheduler only decodes a request's tail to match stop strings).

HTTP -> engine::

    ("add", rid, input_ids, sampling_params_dict, priority, bootstrap, cache_salt, client, dp_rank, lora_path)
                                        priority: int or None; bootstrap: dict or None;
                                        cache_salt: the prefix-cache namespace, or None;
                                        client: the HTTP peer's address
    ("abort", rid)
    ("call", call_id, name, args)       name in CALLS
    ("shutdown",)

engine -> HTTP::

    ("ready", info) | ("failed", message)
    ("out", [Update, ...])              once per scheduler step that produced something
    ("reply", call_id, value)

Before every scheduler step the loop takes every message already waiting on the pipe, so
an abort takes effect at the next step however busy the engine is. When the scheduler
raises out of ``step()`` (it isolates per-request failures itself and raises only after
``--max-consecutive-failed-steps`` failing steps in a row), the engine sends what the
failed step produced, then ``("failed", reason)``, and exits with code 1. When the HTTP
process goes away (its pipe closes, or it is killed), the engine stops too: the loop sees
the closed pipe before its next step, and a watcher thread ends the process within
``PARENT_GRACE_S`` seconds even while the model is still loading.

With ``--tp-size N`` the Engine here is rank 0 and starts the other ranks itself
(:mod:`radixserve.distributed.ranks`). A rank that dies or loses step makes the loop send
``("failed", reason)`` and exit 1 at its next turn (the running step's requests fail);
``RANK_FAILURE_EXIT_S`` after the failure the process exits regardless.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LEAK_EXIT_CODE = 3  # the engine stopped with KV pages or request slots unaccounted for
FAILED_EXIT_CODE = 1  # the engine failed to start or its loop failed
PARENT_GRACE_S = 2.0  # after the HTTP process is gone, the engine exits within this long
RANK_FAILURE_EXIT_S = 5.0  # after a rank of a multi-rank engine died, the engine exits within this long


class EngineLoopFailed(RuntimeError):
    """The scheduler raised out of step(): the engine cannot go on."""


class ParentGone(Exception):
    """The HTTP process closed its end of a pipe."""


@dataclass
class Update:
    """New tokens of one request since the last update (and, when finished, its ending)."""

    rid: str
    new_ids: list[int]
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stop_text: str | None = None  # full output text with the stop string trimmed
    logprobs: list[float] = field(default_factory=list)  # one per new id (if asked)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # prompt logprobs (return_logprob with logprob_start_len >= 0), once, in the first update
    # after the prefill: (logprob or None for token 0, token id) per prompt token from
    # logprob_start_len on, and the top (ids, logprobs) per position (None for token 0)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # speculative decoding (None when it is off): the request's verify steps so far and the
    # draft tokens they accepted (running totals, not deltas)
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0
    # return_hidden_states: new rows in SGLang's layout (the prompt's rows as one entry in the
    # first update after the prefill, then one row per output token after the first)
    hidden_states: list | None = None


def rejected(rid: str, message: str, param: str | None = None, status_code: int = 400) -> Update:
    return Update(rid, [], True, {"type": "abort", "message": message, "param": param,
                                  "status_code": status_code})


class EngineLoop:
    """Owns the core Engine in this process and serves the pipe protocol."""

    def __init__(self, engine, recv_conn, send_conn) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.recv = recv_conn
        self.send = send_conn
        self.sent: dict[str, int] = {}  # rid -> output ids already reported
        self.dirty: dict[str, Any] = {}  # rid -> Req with news to report
        self.running = True

    # --------------------------------------------------------------- intake
    def _on_output(self, req, num_new: int, finished: bool) -> None:
        self.dirty[req.rid] = req

    def _add(self, rid: str, input_ids: list[int], params: dict, priority: int | None = None,
             bootstrap: dict | None = None, cache_salt: str | None = None, client: str | None = None,
             dp_rank: int | None = None, lora_path: str | None = None) -> None:
        from radixserve.engine.scheduler import RequestRejected
        from radixserve.sampling import InvalidSamplingParams

        try:
            ids, plist, _ = self.engine.normalize(None, input_ids, params)
            (req,), = self.engine.make_requests(ids, plist, rids=[rid], priorities=[priority],
                                                cache_salt=cache_salt, lora_path=[lora_path])
            req.bootstrap = bootstrap
            req.client = client  # the HTTP peer's address: --grammar-max-compiles-per-client
            req.dp_rank = dp_rank  # DP attention: the attention group asked for (routed_dp_rank)
            req.on_output = self._on_output
            self.sched.add_request(req)
            self.sent[rid] = 0
        except InvalidSamplingParams as e:
            self.send.send(("out", [rejected(rid, str(e), e.param)]))
        except RequestRejected as e:
            self.send.send(("out", [rejected(rid, str(e), e.param)]))
        except ValueError as e:
            self.send.send(("out", [rejected(rid, str(e))]))
        except Exception as e:  # noqa: BLE001 - one bad request never stops the engine
            logger.exception("request %s could not be added", rid)
            self.sent.pop(rid, None)
            self.send.send(("out", [rejected(rid, f"internal error: {type(e).__name__}: {e}",
                                             status_code=500)]))

    def _call(self, name: str) -> Any:
        if name == "get_stats":  # + the objects the process left out of garbage collection
            return {**self.sched.get_stats(), "gc_frozen_objects": gc.get_freeze_count()}
        if name == "flush_cache":
            return self.sched.flush_cache()
        if name in ("start_expert_distribution_record", "stop_expert_distribution_record",
                    "dump_expert_distribution_record"):
            try:
                return {"path": self.sched.expert_distribution_record(name.split("_", 1)[0])}
            except ValueError as e:
                return {"error": str(e), "bad_request": True}
        if name == "check_idle":  # the leak invariant; None when it holds
            if self.sched.has_work:
                return "busy"
            try:
                self.sched.check_idle_invariant()
            except AssertionError as e:
                return str(e)
            return None
        raise ValueError(f"unknown call {name!r}")

    def _lora_call(self, name: str, lora_name: str, lora_path: str | None = None) -> dict:
        """``load_lora_adapter`` / ``unload_lora_adapter``: SGLang's answer (``success``,
        ``error_message``, ``loaded_adapters``). An adapter that queued or running requests use
        is not unloaded (the caller retries once they finish)."""
        from radixserve.lora.adapter import LoRAError

        try:
            if name == "load_lora_adapter":
                self.engine.load_lora_adapter(lora_name, lora_path)
            else:
                self.engine.unload_lora_adapter(lora_name)
        except LoRAError as e:
            return {"success": False, "error_message": str(e), "bad_request": True}
        return {"success": True, "error_message": "",
                "loaded_adapters": {n: a.path for n, a in self.engine.runner.lora.adapters.items()}}

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            try:
                self.sched.abort(msg[1])
            except Exception:  # noqa: BLE001 - logged; the request's own update says the rest
                logger.exception("aborting request %s failed", msg[1])
        elif kind == "call":
            _, call_id, name, args = msg
            try:
                value = self._lora_call(name, *args) if name.endswith("_lora_adapter") else self._call(name)
            except Exception as e:  # a bad call never stops the engine
                value = {"error": repr(e)}
            self.send.send(("reply", call_id, value))
        elif kind == "shutdown":
            self.running = False

    # ---------------------------------------------------------------- output
    def _flush(self) -> None:
        if not self.dirty:
            return
        from radixserve.engine.engine import prompt_logprob_entries
        updates = []
        for rid, req in self.dirty.items():
            start = self.sent.get(rid, 0)
            new_ids = req.output_ids[start:]
            u = Update(rid, list(new_ids), req.finished, req.finish_reason,
                       len(req.input_ids), req.cached_tokens, req.stop_text)
            if req.params.return_logprob:
                u.logprobs = req.output_token_logprobs[start:]
                if req.params.top_logprobs_num:
                    u.top_logprobs = req.output_top_logprobs[start:]
                if req.params.wants_prompt_logprobs and start == 0 and (req.output_ids or req.finished):
                    u.input_token_logprobs, tops = prompt_logprob_entries(req)
                    if req.params.top_logprobs_num:
                        u.input_top_logprobs = tops
            if req.params.return_hidden_states and (req.output_ids or req.finished):
                u.hidden_states = req.hidden_states[req.hidden_sent:]  # complete entries only
                req.hidden_sent = len(req.hidden_states)
            if self.sched.spec is not None:
                u.spec_verify_ct = req.spec_verify_ct
                u.spec_accepted_tokens = req.spec_accepted_tokens
            if req.finished:
                self.sent.pop(rid, None)
            else:
                self.sent[rid] = len(req.output_ids)
            updates.append(u)
        self.dirty.clear()
        self.send.send(("out", updates))

    def _take_messages(self, timeout: float) -> None:
        """Handle every message waiting on the pipe (blocking up to ``timeout`` for the first)."""
        try:
            while self.recv.poll(timeout):
                self._handle(self.recv.recv())
                timeout = 0
                if not self.running:
                    return
        except (EOFError, OSError) as e:
            raise ParentGone() from e

    def _send_out(self) -> None:
        try:
            self._flush()
        except (BrokenPipeError, EOFError, OSError) as e:
            raise ParentGone() from e

    def _rank_failure(self) -> str | None:
        """Why a rank of a multi-rank engine failed (None: all well, or a single rank)."""
        return getattr(self.engine, "rank_failure", None)

    def run(self) -> None:
        """Serve until ("shutdown",); raises ParentGone or EngineLoopFailed otherwise."""
        sched = self.sched
        while self.running:
            if self._rank_failure() is not None:  # --tp-size > 1: a rank died or lost step
                raise EngineLoopFailed(self._rank_failure())
            # Block briefly for work when idle; otherwise take whatever is queued (all of it,
            # so aborts sent while the last step ran take effect before this one).
            self._take_messages(0 if sched.has_work else 0.05)
            if sched.has_work and self.running:
                try:
                    sched.step()
                except Exception as e:
                    reason = f"{type(e).__name__}: {e}"
                    logger.exception("the scheduler failed; the engine stops")
                    try:  # what the failed step finished (its requests' 500s) goes out first
                        self._flush()
                    except Exception:  # noqa: BLE001
                        pass
                    raise EngineLoopFailed(reason) from e
                if self._rank_failure() is not None:  # the step's requests failed with it
                    self._send_out()
                    raise EngineLoopFailed(self._rank_failure())
            self._send_out()
        sched.abort_all({"type": "abort", "message": "the engine shut down", "status_code": 503})
        self._send_out()

    def leak_report(self) -> str | None:
        """After the loop: the idle invariant (every KV page free or cached), or what broke it."""
        try:
            self.sched.check_idle_invariant()
        except AssertionError as e:
            return str(e)
        return None


def freeze_long_lived() -> None:
    """Call once a process has started serving: what is alive now (torch, the model, the
    tokenizer: ~400k objects) stays alive until exit, so it moves out of the garbage
    collector's reach (``gc.freeze``). A full collection otherwise walks all of it, ~200-260 ms
    on a small CPU, at an unpredictable step of a busy server (one or more per benchmark run:
    a stall of every running request). Only the young generations are collected first (~3 ms):
    a full collection at this point found 78 unreachable objects in 245 ms, not worth a
    quarter second of every start-up."""
    gc.collect(1)
    gc.freeze()


def skip_final_collection() -> None:
    """Call when the process is about to exit: the interpreter's teardown then leaves the
    objects alive now (torch's modules, the model) out of its garbage collections, which
    otherwise take 1-2 s on a small CPU before the exit code reaches the parent. atexit
    handlers, reference-count frees and stream flushing still run."""
    gc.freeze()


def _watch_parent() -> None:
    """End this process soon after the HTTP process is gone (even while loading the model,
    when nothing reads the pipe). The loop normally sees the closed pipe first and exits
    cleanly; this is the backstop."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        time.sleep(PARENT_GRACE_S)
        os._exit(FAILED_EXIT_CODE)

    threading.Thread(target=watch, name="radixserve-parent-watch", daemon=True).start()


def _exit_soon_after_rank_failure(reason: str) -> None:
    """Backstop for a multi-rank engine whose rank died: the loop normally reports it and
    exits at once; if the main thread is stuck in a collective, exit anyway."""
    def later() -> None:
        time.sleep(RANK_FAILURE_EXIT_S)
        logger.error("the engine loop did not stop after a rank failed (%s); exiting", reason)
        os._exit(FAILED_EXIT_CODE)

    threading.Thread(target=later, name="radixserve-rank-failure-exit", daemon=True).start()


def engine_main(engine_kwargs: dict, recv_conn, send_conn) -> None:
    """Entry point of the engine process (started with the ``spawn`` method)."""
    # The HTTP process owns shutdown: a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent()
    try:
        from radixserve.engine.engine import Engine
        from radixserve.engine.model_runner import kv_dtype_name

        engine = Engine(**engine_kwargs)
    except BaseException as e:  # report and leave; the HTTP process exits with the message
        logger.debug("engine start failed:\n%s", traceback.format_exc())
        try:
            send_conn.send(("failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(FAILED_EXIT_CODE) from None
    engine.on_rank_failure = _exit_soon_after_rank_failure
    if engine.rank_failure is not None:  # a rank died before this was set
        _exit_soon_after_rank_failure(engine.rank_failure)
    info = {
        "context_length": engine.runner.context_len,
        "vocab_size": engine.model_config.vocab_size,
        "request_limits": dataclasses.asdict(engine.server_args.limit_args),
        "max_total_tokens": engine.runner.max_total_tokens,
        "page_size": engine.server_args.page_size,
        "pid": os.getpid(),
        "device": str(engine.runner.device),
        "tp_size": engine.server_args.tp_size,
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        # the KV pool's storage dtype as --kv-cache-dtype spells it (auto resolved)
        "kv_cache_dtype": kv_dtype_name(engine.runner.kv_dtype),
        "prefill_attention_backend": engine.server_args.prefill_backend_name,
        "decode_attention_backend": engine.server_args.decode_backend_name,
        "grammar_backend": engine.scheduler.grammar.backend.name if engine.scheduler.grammar else "none",
        "grammar_max_spec_bytes": engine.server_args.grammar_max_spec_bytes,  # checked before sending too
        "speculative_algorithm": engine.server_args.speculative_algorithm if engine.scheduler.spec else None,
        "model_path": engine.checkpoint.path,
        "architecture": engine.model_config.architecture,
        "model_type": getattr(engine.model_config, "model_type", None),
        "sampling_defaults": engine.sampling_defaults or None,  # what a request's silent fields get
    }
    loop = EngineLoop(engine, recv_conn, send_conn)
    freeze_long_lived()
    try:
        try:
            send_conn.send(("ready", info))
        except OSError as e:
            raise ParentGone() from e
        loop.run()
    except ParentGone:
        logger.warning("the HTTP process went away; the engine stops")
        return
    except BaseException as e:
        if not isinstance(e, EngineLoopFailed):
            logger.exception("engine loop failed")
        reason = f"engine loop failed: {e}" if isinstance(e, EngineLoopFailed) else \
            f"engine loop failed: {type(e).__name__}: {e}"
        try:
            send_conn.send(("failed", reason))
        except Exception:  # noqa: BLE001 - the HTTP side also sees the process exit
            pass
        raise SystemExit(FAILED_EXIT_CODE) from None
    finally:
        engine.shutdown()
        skip_final_collection()
    problem = loop.leak_report()
    if problem is not None:  # the exit code tells the HTTP process, which exits non-zero too
        logger.error("engine stopped with %s", problem)
        raise SystemExit(LEAK_EXIT_CODE)
