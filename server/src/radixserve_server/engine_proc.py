"""The engine process: loads the model and runs the scheduler on its main thread.

It talks to the HTTP process over two pipes of pickled tuples. Prompts arrive already
tokenised and outputs leave as token ids; text work stays in the HTTP process (the
scheduler only decodes a request's tail to match stop strings).

HTTP -> engine::

    ("add", rid, input_ids, sampling_params_dict)
    ("abort", rid)
    ("call", call_id, name)             name in CALLS
    ("shutdown",)

engine -> HTTP::

    ("ready", info) | ("failed", message)
    ("out", [Update, ...])              once per scheduler step that produced something
    ("reply", call_id, value)
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


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

    def _add(self, rid: str, input_ids: list[int], params: dict) -> None:
        from radixserve.engine.scheduler import RequestRejected
        from radixserve.sampling import InvalidSamplingParams

        try:
            ids, plist, _ = self.engine.normalize(None, input_ids, params)
            (req,), = self.engine.make_requests(ids, plist, rids=[rid])
            req.on_output = self._on_output
            self.sched.add_request(req)
            self.sent[rid] = 0
        except InvalidSamplingParams as e:
            self.send.send(("out", [rejected(rid, str(e), e.param)]))
        except RequestRejected as e:
            self.send.send(("out", [rejected(rid, str(e), e.param)]))
        except ValueError as e:
            self.send.send(("out", [rejected(rid, str(e))]))

    def _call(self, name: str) -> Any:
        if name == "get_stats":
            return self.sched.get_stats()
        if name == "flush_cache":
            return self.sched.flush_cache()
        if name == "check_idle":  # the leak invariant; None when it holds
            if self.sched.has_work:
                return "busy"
            try:
                self.sched.check_idle_invariant()
            except AssertionError as e:
                return str(e)
            return None
        raise ValueError(f"unknown call {name!r}")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            self.sched.abort(msg[1])
        elif kind == "call":
            _, call_id, name = msg
            try:
                value = self._call(name)
            except Exception as e:  # a bad call never stops the engine
                value = {"error": repr(e)}
            self.send.send(("reply", call_id, value))
        elif kind == "shutdown":
            self.running = False

    # ---------------------------------------------------------------- output
    def _flush(self) -> None:
        if not self.dirty:
            return
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
            if req.finished:
                self.sent.pop(rid, None)
            else:
                self.sent[rid] = len(req.output_ids)
            updates.append(u)
        self.dirty.clear()
        self.send.send(("out", updates))

    def run(self) -> None:
        sched = self.sched
        while self.running:
            # Block briefly for work when idle; otherwise take whatever is queued.
            timeout = 0 if sched.has_work else 0.05
            while self.recv.poll(timeout):
                self._handle(self.recv.recv())
                timeout = 0
                if not self.running:
                    break
            if sched.has_work and self.running:
                sched.step()
            self._flush()
        for req in list(sched.waiting) + list(sched.running):
            sched.abort(req.rid)
        self._flush()

    def leak_report(self) -> str | None:
        """After the loop: the idle invariant (every KV page free or cached), or what broke it."""
        try:
            self.sched.check_idle_invariant()
        except AssertionError as e:
            return str(e)
        return None


def engine_main(engine_kwargs: dict, recv_conn, send_conn) -> None:
    """Entry point of the engine process (started with the ``spawn`` method)."""
    # The HTTP process owns shutdown: a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from radixserve.engine.engine import Engine

        engine = Engine(**engine_kwargs)
    except BaseException as e:  # report and leave; the HTTP process exits with the message
        send_conn.send(("failed", f"{type(e).__name__}: {e}"))
        logger.debug("engine start failed:\n%s", traceback.format_exc())
        return
    info = {
        "context_length": engine.runner.context_len,
        "vocab_size": engine.model_config.vocab_size,
        "max_total_tokens": engine.runner.max_total_tokens,
        "page_size": engine.server_args.page_size,
        "pid": os.getpid(),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
    }
    send_conn.send(("ready", info))
    loop = EngineLoop(engine, recv_conn, send_conn)
    try:
        loop.run()
    except (EOFError, BrokenPipeError, OSError):
        return  # the HTTP process went away
    except BaseException as e:
        logger.exception("engine loop failed")
        try:
            send_conn.send(("failed", f"engine loop failed: {type(e).__name__}: {e}"))
        except Exception:
            pass
        raise SystemExit(1) from e
    finally:
        engine.shutdown()
    problem = loop.leak_report()
    if problem is not None:  # the exit code tells the HTTP process, which exits non-zero too
        logger.error("engine stopped with %s", problem)
        raise SystemExit(LEAK_EXIT_CODE)


LEAK_EXIT_CODE = 3
