"""``radixserve serve`` (also ``python -m radixserve.launch_server``): start the engine process and
the HTTP server, and drain on SIGTERM.

Start-up checks the cheap things first: the listening socket is bound (``--host``,
``--port``) before the checkpoint, tokenizer or engine load, so an occupied port or a bad
address is reported at once.

Shutdown, in any order of signals:

- SIGTERM or the first Ctrl-C: stop accepting (new requests get 503), let in-flight
  requests finish for up to ``--shutdown-timeout`` seconds, abort the rest, stop the engine
  and exit 0.
- A second signal (SIGINT or SIGTERM) while draining: every in-flight request ends at once
  with a 503 (an OpenAI-style body; a started stream gets an SSE error event and
  ``[DONE]``), then the server exits 0. A third signal exits without waiting.
- The engine process dies or its loop fails (at any time after start-up, draining
  included): ``/health`` turns 503 with the reason, every waiting request gets a 503 at
  once, and the process exits 1 within a few seconds so a supervisor restarts it.

With ``--dp-size N`` the server runs N engine processes behind a router
(:mod:`radixserve_server.router.dp`); any one of them failing to start, dying or failing
counts as "the engine" above: the others' requests get 503 and the server exits 1.

With ``--nnodes N --node-rank R`` (R > 0) nothing listens: the process runs node R's ranks
of the replica whose node 0 serves, and exits when that replica stops (0) or a rank fails (1).

Exit codes: 0 clean stop; 1 the engine failed to start, died, failed or leaked KV pages;
2 bad flags (including an occupied port or an address this machine does not have).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from radixserve.config import ConfigError, ServerArgs
from radixserve.secrets import redact_url

from radixserve_server.engine_client import post
from radixserve_server.engine_proc import LEAK_EXIT_CODE, freeze_long_lived, skip_final_collection
from radixserve_server.http_args import HTTPArgs, add_hardening_arguments, apply_hardening
from radixserve_server.router.policy import PolicyArgs, add_policy_arguments, policy_args_from
from radixserve_server.sockets import bind_sockets

if TYPE_CHECKING:
    from radixserve_server.app import ServerState

logger = logging.getLogger("radixserve.server")

DEATH_LINGER_S = 1.0  # after the engine dies: answer /health (503, the reason) this long, then exit
GRACEFUL_S = 5.0  # uvicorn waits this long for open responses when the server stops
EXIT_FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=int, default=30000, help="port to listen on")
    http.add_argument("--api-key", default=None,
                      help="require this key (Authorization: Bearer KEY or x-api-key) on every route but /health "
                           "and /metrics; prefer --api-key-file or RADIXSERVE_API_KEY (a flag shows in ps)")
    add_hardening_arguments(http)
    http.add_argument("--cors-origins", nargs="*", default=[],
                      help="allow cross-origin requests from these origins ('*' for any); off by default")
    http.add_argument("--max-payload-size", type=int, default=32 * 2**20,
                      help="largest request body in bytes (larger ones get 413)")
    http.add_argument("--max-batch-prompts", type=int, default=128,
                      help="most prompts, n, and prompts x n in one request (more get 400)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests may run after SIGTERM before they are aborted")
    http.add_argument("--served-model-name", default=None, help="model name clients use (default: from the checkpoint)")
    http.add_argument("--tool-call-parser", default=None,
                      help="format of the model's tool calls for tool_choice auto (hermes, qwen25, llama3, "
                           "mistral, pythonic, ...); without it auto returns plain content")
    http.add_argument("--tool-call-max-string-length", type=int, default=512,
                      help="under tool_choice required or named, the longest free string argument (one "
                           "without maxLength, pattern, enum or format) generated, so a model looping "
                           "inside a string still ends its call; 0 for no limit")
    http.add_argument("--enable-metrics", action="store_true",
                      help="accepted for SGLang's command lines: /metrics is always on")
    http.add_argument("--log-requests", action="store_true",
                      help="log one line per generation request (a request's no_logs: true keeps it out)")
    http.add_argument("--log-requests-level", type=int, default=2, choices=range(4), metavar="{0,1,2,3}",
                      help="with --log-requests: 0 ids and sizes, 1 also sampling parameters, 2 also the "
                           "first 256 characters of the prompt, 3 all of it (default 2)")
    ServerArgs.add_cli_args(parser)
    # --dp-size N (a ServerArgs flag): how the server spreads requests over its N engines
    add_policy_arguments(parser, "--load-balance-method", "--policy")


def http_args_from(ns: argparse.Namespace) -> HTTPArgs:
    args = HTTPArgs(host=ns.host, port=ns.port, api_key=ns.api_key, cors_origins=list(ns.cors_origins or []),
                    max_payload_size=ns.max_payload_size, max_batch_prompts=ns.max_batch_prompts,
                    shutdown_timeout=ns.shutdown_timeout,
                    served_model_name=ns.served_model_name, tool_call_parser=ns.tool_call_parser,
                    tool_call_max_string_length=ns.tool_call_max_string_length,
                    log_requests=ns.log_requests, log_requests_level=ns.log_requests_level)
    apply_hardening(ns, args)
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_payload_size < 1:
        raise ConfigError(f"--max-payload-size must be >= 1, got {args.max_payload_size}")
    if args.max_batch_prompts < 1:
        raise ConfigError(f"--max-batch-prompts must be >= 1, got {args.max_batch_prompts}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.tool_call_max_string_length < 0:
        raise ConfigError(f"--tool-call-max-string-length must be >= 0, got {args.tool_call_max_string_length}")
    if args.tool_call_parser is not None:
        from radixserve_server.tool_calling import get_tool_parser

        try:
            get_tool_parser(args.tool_call_parser)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return args


def model_name_of(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def _uvicorn_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with our signal handling (see the module docstring)."""

        state: ServerState
        signals = 0

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()

            def on_signal(sig, frame):
                self.signals += 1
                if self.signals >= 3:
                    self.force_exit = True
                    self.should_exit = True
                    return
                step = self.drain if self.signals == 1 else self.cut_short
                post(loop, lambda: loop.create_task(step()))

            originals = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in originals.items():
                    signal.signal(s, h)

        async def drain(self) -> None:
            state = self.state
            if state.status in ("draining", "failed"):  # failed: exiting already
                return
            state.status = "draining"
            client = state.client
            logger.warning("draining: %d requests in flight, up to %.0f s", client.num_in_flight(),
                           state.http.shutdown_timeout)
            deadline = time.monotonic() + state.http.shutdown_timeout
            while client.num_in_flight() and time.monotonic() < deadline and client.alive:
                await asyncio.sleep(0.05)
            left = client.in_flight()
            for rid in left:
                client.abort(rid)
            if left:
                logger.warning("aborted %d requests still running at the shutdown timeout", len(left))
                deadline = time.monotonic() + 5.0
                while client.num_in_flight() and time.monotonic() < deadline and client.alive:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # let the last responses flush
            self.should_exit = True

        async def cut_short(self) -> None:
            """The second signal: end every in-flight request now with a 503, then stop
            (uvicorn still lets their responses finish writing)."""
            if self.state.status != "failed":
                self.state.status = "draining"
            n = self.state.client.fail_all("the server was stopped before this request finished")
            logger.warning("stopping now: %d in-flight requests answered with 503", n)
            await asyncio.sleep(0.1)
            self.should_exit = True

    return DrainingServer


def run_server(engine_args: ServerArgs, http: HTTPArgs, policy: PolicyArgs | None = None) -> int:
    from radixserve.registry import get_registry

    logging.basicConfig(level=engine_args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if http.log_requests:  # whatever --log-level says
        logging.getLogger("radixserve.requests").setLevel(logging.INFO)
    registry = get_registry()
    # Fail fast on a bad backend name, before the engine process starts.
    registry.resolve("attention", engine_args.prefill_backend_name, flag=engine_args.backend_flag("prefill"))
    registry.resolve("attention", engine_args.decode_backend_name, flag=engine_args.backend_flag("decode"))
    socks = bind_sockets(http.host, http.port)  # before anything slow: a taken port fails at once
    try:
        return _serve(engine_args, http, socks, policy)
    finally:
        for sock in socks:
            sock.close()


class _DeathWatch:
    """``on_death`` for an engine client started before the event loop exists: sets the
    loop's event once :meth:`attach` has given one, and at attach time if the engine died
    before (whichever thread comes second sees the other's write)."""

    def __init__(self) -> None:
        self.dead = False
        self.target: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def __call__(self, message: str) -> None:
        self.dead = True
        if self.target is not None:
            post(self.target[0], self.target[1].set)

    def attach(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        self.target = (loop, event)
        if self.dead:
            event.set()


def _serve(engine_args: ServerArgs, http: HTTPArgs, socks: list[socket.socket], policy: PolicyArgs | None) -> int:
    import uvicorn
    from radixserve.model_loader import load_checkpoint
    from radixserve.reasoning import build_reasoning_spec
    from radixserve.tokenizer import load_tokenizer

    from radixserve_server.app import Guard, ServerState, create_app
    from radixserve_server.engine_client import EngineClient
    from radixserve_server.http_timeouts import timed_protocol
    from radixserve_server.peer import PeerAddress

    ckpt = load_checkpoint(engine_args.model)
    kwargs = dataclasses.asdict(engine_args)
    if engine_args.dp_size > 1 and not engine_args.enable_dp_attention:  # DP attention: one replica's groups
        from radixserve_server.router.dp import DataParallelClient

        client = DataParallelClient(kwargs, engine_args.dp_size, policy)
    else:
        client = EngineClient(kwargs)
    # The engine process starts now: its imports and weights load while this process reads
    # the tokenizer and builds the app (the two overlap on separate cores). A death before
    # the event loop runs is remembered and reported once it does.
    death_watch = _DeathWatch()
    client.on_death = death_watch
    client.start()
    try:
        tokenizer = load_tokenizer(engine_args.tokenizer_path or ckpt.tokenizer_dir,
                                   None if engine_args.tokenizer_path else ckpt.gguf_file, engine_args.chat_template)
        reasoning = build_reasoning_spec(engine_args.reasoning_parser, tokenizer.hf)
        model_name = http.served_model_name or model_name_of(ckpt.path)
        state = ServerState(client, tokenizer, http, model_name, kwargs)
        state.reasoning = reasoning
        app = create_app(state)
        if http.cors_origins:
            from fastapi.middleware.cors import CORSMiddleware

            app.add_middleware(CORSMiddleware, allow_origins=http.cors_origins, allow_methods=["*"],
                               allow_headers=["*"], allow_credentials="*" not in http.cors_origins)
    except BaseException:
        client.shutdown()
        raise
    asgi = PeerAddress(Guard(app, http))
    # uvicorn counts the connection a request came on: +1 lets --max-connections connections in
    limit = http.max_connections + 1 if http.max_connections else None
    config = uvicorn.Config(asgi, log_level=engine_args.log_level, timeout_graceful_shutdown=GRACEFUL_S,
                            access_log=False, http=timed_protocol(http.http_header_timeout, http.http_body_timeout),
                            timeout_keep_alive=http.timeout_keep_alive, limit_concurrency=limit)
    server = _uvicorn_server_class()(config)
    server.state = state
    failure: list[str] = []  # the engine failed to start
    death: list[str] = []  # the engine died or failed after start-up
    host, port = socks[0].getsockname()[:2]
    where = f"[{host}]" if ":" in host else host

    async def watch_engine(died: asyncio.Event) -> None:
        while not client.started:
            await asyncio.sleep(0.05)
        if client.error is not None:
            failure.append(client.error)
            state.mark_failed()
            server.should_exit = True
            return
        if state.status == "draining":  # a signal came while the engine was loading
            return
        freeze_long_lived()
        state.mark_ready()
        logger.warning("radixserve serving %s on http://%s:%d", model_name, where, port)
        await died.wait()  # set by the reader thread the moment the engine is gone
        death.append(client.error or "the engine stopped")
        state.mark_failed()
        logger.error("the engine is gone (%s); waiting requests got 503, exiting with code %d",
                     redact_url(death[0]), EXIT_FAILED)
        await asyncio.sleep(DEATH_LINGER_S)
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        died = asyncio.Event()
        death_watch.attach(loop, died)
        watcher = asyncio.create_task(watch_engine(died))
        try:
            await server.serve(sockets=socks)
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        state.json_process.close()
        code = client.shutdown()
        skip_final_collection()  # this process exits next
    if failure:
        print(f"radixserve: error: the engine failed to start: {redact_url(failure[0])}", file=sys.stderr)
        return EXIT_FAILED
    if death:
        print(f"radixserve: error: the engine stopped while serving: {redact_url(death[0])}", file=sys.stderr)
        return EXIT_FAILED
    if not server.started:
        return EXIT_FAILED
    if code == LEAK_EXIT_CODE:
        print("radixserve: error: the engine stopped with KV pages or request slots unaccounted for "
              "(see its log)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def serve_command(ns: argparse.Namespace) -> int:
    engine_args = ServerArgs.from_cli_args(ns)
    if engine_args.node_rank > 0:  # --nnodes N: this node runs follower ranks only, no server
        from radixserve.distributed.ranks import run_follower_node

        logging.basicConfig(level=engine_args.log_level.upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return run_follower_node(engine_args)
    http = http_args_from(ns)
    return run_server(engine_args, http, policy_args_from(ns))
