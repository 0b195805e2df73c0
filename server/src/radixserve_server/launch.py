"""``radixserve serve`` (also ``python -m radixserve.launch_server``): start the engine process and
the HTTP server, and drain on SIGTERM.

Shutdown on SIGTERM (or the first Ctrl-C): stop accepting (new requests get 503), let
in-flight requests finish for up to ``--shutdown-timeout`` seconds, abort the rest, stop
the engine and exit 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

from radixserve.config import ConfigError, ServerArgs

from radixserve_server.app import Guard, HTTPArgs, ServerState, create_app
from radixserve_server.engine_proc import LEAK_EXIT_CODE

logger = logging.getLogger("radixserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=int, default=30000, help="port to listen on")
    http.add_argument("--api-key", default=None,
                      help="require this key (Authorization: Bearer KEY or x-api-key); health and metrics stay open")
    http.add_argument("--cors-origins", nargs="*", default=[],
                      help="allow cross-origin requests from these origins ('*' for any); off by default")
    http.add_argument("--max-payload-size", type=int, default=32 * 2**20,
                      help="largest request body in bytes (larger ones get 413)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests may run after SIGTERM before they are aborted")
    http.add_argument("--served-model-name", default=None, help="model name clients use (default: from the checkpoint)")
    ServerArgs.add_cli_args(parser)


def http_args_from(ns: argparse.Namespace) -> HTTPArgs:
    args = HTTPArgs(host=ns.host, port=ns.port, api_key=ns.api_key, cors_origins=list(ns.cors_origins or []),
                    max_payload_size=ns.max_payload_size, shutdown_timeout=ns.shutdown_timeout,
                    served_model_name=ns.served_model_name)
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_payload_size < 1:
        raise ConfigError(f"--max-payload-size must be >= 1, got {args.max_payload_size}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    return args


def model_name_of(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def _uvicorn_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with our signal handling: drain, then exit 0."""

        state: ServerState

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()

            def on_signal(sig, frame):
                if self.state.status == "draining" or sig == signal.SIGINT and self.should_exit:
                    self.force_exit = True
                    self.should_exit = True
                    return
                loop.call_soon_threadsafe(lambda: loop.create_task(self.drain()))

            originals = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in originals.items():
                    signal.signal(s, h)

        async def drain(self) -> None:
            state = self.state
            if state.status == "draining":
                return
            previous, state.status = state.status, "draining"
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
            del previous
            self.should_exit = True

    return DrainingServer


def run_server(engine_args: ServerArgs, http: HTTPArgs) -> int:
    import uvicorn
    from radixserve.model_loader import load_checkpoint
    from radixserve.registry import get_registry
    from radixserve.tokenizer import load_tokenizer

    from radixserve_server.engine_client import EngineClient

    logging.basicConfig(level=engine_args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    registry = get_registry()
    # Fail fast on a bad backend name, before the engine process starts.
    registry.resolve("attention", engine_args.prefill_backend_name, flag=engine_args.backend_flag("prefill"))
    registry.resolve("attention", engine_args.decode_backend_name, flag=engine_args.backend_flag("decode"))
    ckpt = load_checkpoint(engine_args.model)
    tokenizer = load_tokenizer(engine_args.tokenizer_path or ckpt.tokenizer_dir,
                               None if engine_args.tokenizer_path else ckpt.gguf_file, engine_args.chat_template)
    model_name = http.served_model_name or model_name_of(ckpt.path)
    kwargs = dataclasses.asdict(engine_args)
    client = EngineClient(kwargs)
    client.start()
    state = ServerState(client, tokenizer, http, model_name, kwargs)
    app = create_app(state)
    if http.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=http.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in http.cors_origins)
    asgi = Guard(app, http.api_key)
    config = uvicorn.Config(asgi, host=http.host, port=http.port, log_level=engine_args.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = _uvicorn_server_class()(config)
    server.state = state
    failure: list[str] = []

    async def watch_engine() -> None:
        while not client._ready.is_set():
            await asyncio.sleep(0.05)
        if client.error is not None:
            failure.append(client.error)
            state.mark_failed()
            server.should_exit = True
            return
        state.mark_ready()
        logger.warning("radixserve serving %s on http://%s:%d", model_name, http.host, http.port)
        while not server.should_exit:  # an engine that dies later fails requests with 503
            if not client.alive and client.error is None and state.status == "ready":
                client.error = "the engine process exited"
            await asyncio.sleep(0.5)

    async def main() -> None:
        watcher = asyncio.create_task(watch_engine())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        code = client.shutdown()
    if failure:
        print(f"radixserve: error: the engine failed to start: {failure[0]}", file=sys.stderr)
        return 1
    if not server.started:
        return 1
    if code == LEAK_EXIT_CODE:
        print("radixserve: error: the engine stopped with KV pages or request slots unaccounted for "
              "(see its log)", file=sys.stderr)
        return 1
    return 0


def serve_command(ns: argparse.Namespace) -> int:
    http = http_args_from(ns)
    return run_server(ServerArgs.from_cli_args(ns), http)
