"""``radixserve router --worker-urls URL [URL ...]``: the standalone router (see :mod:`.proxy`).

It loads no model and no torch: a small process in front of ``radixserve serve``
instances (on this machine or others). SIGTERM or Ctrl-C stops it after the open
responses finish (uvicorn's graceful stop). Exit codes: 0 clean stop, 2 bad flags
(including an occupied port).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

from radixserve.config import ConfigError

from radixserve_server.router.args import RouterArgs
from radixserve_server.router.policy import add_policy_arguments, policy_args_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                        help="the radixserve serve instances to route to, e.g. http://127.0.0.1:30001")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    add_policy_arguments(parser, "--policy")
    health = parser.add_argument_group("worker health")
    health.add_argument("--health-check-interval-secs", type=float, default=10.0,
                        help="seconds between health checks of every worker (default: 10)")
    health.add_argument("--health-check-timeout-secs", type=float, default=5.0,
                        help="seconds a worker's /health may take (default: 5)")
    health.add_argument("--health-failure-threshold", type=int, default=3,
                        help="failed checks in a row that remove a worker (default: 3); a request that "
                             "cannot reach its worker removes it after one failed check")
    health.add_argument("--health-success-threshold", type=int, default=2,
                        help="passed checks in a row that bring a removed worker back (default: 2)")
    health.add_argument("--worker-startup-timeout-secs", type=float, default=300.0,
                        help="at start-up, wait this long for every worker to be healthy (default: 300); "
                             "later ones are added when they answer")
    parser.add_argument("--request-timeout-secs", type=float, default=1800.0,
                        help="longest wait for a worker's next bytes of an answer (default: 1800)")
    parser.add_argument("--max-payload-size", type=int, default=32 * 2**20,
                        help="largest request body in bytes (larger ones get 413)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def router_args_from(ns: argparse.Namespace) -> RouterArgs:
    args = RouterArgs(worker_urls=list(ns.worker_urls), policy=policy_args_from(ns),
                      health_check_interval_secs=ns.health_check_interval_secs,
                      health_check_timeout_secs=ns.health_check_timeout_secs,
                      health_failure_threshold=ns.health_failure_threshold,
                      health_success_threshold=ns.health_success_threshold,
                      worker_startup_timeout_secs=ns.worker_startup_timeout_secs,
                      request_timeout_secs=ns.request_timeout_secs, max_payload_size=ns.max_payload_size)
    for url in args.worker_urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--worker-urls: {url!r} is not an http:// or https:// URL")
    for name in ("health_check_interval_secs", "health_check_timeout_secs", "request_timeout_secs"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("health_failure_threshold", "health_success_threshold", "max_payload_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {ns.port}")
    return args


def _server_class():
    import uvicorn

    class RouterServer(uvicorn.Server):
        """uvicorn's server, stopping on SIGTERM / Ctrl-C with exit code 0 (uvicorn itself
        re-raises the signal once stopped); a second signal stops without waiting."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def on_signal(sig, frame):
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            originals = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in originals.items():
                    signal.signal(s, h)

    return RouterServer


def router_command(ns: argparse.Namespace) -> int:
    import uvicorn

    from radixserve_server.router.proxy import Router, create_router_app
    from radixserve_server.sockets import bind_sockets

    args = router_args_from(ns)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    socks = bind_sockets(ns.host, ns.port)
    try:
        router = Router(args)
        app = create_router_app(router)
        config = uvicorn.Config(app, log_level=ns.log_level, access_log=False, timeout_graceful_shutdown=5)
        server = _server_class()(config)
        host, port = socks[0].getsockname()[:2]
        logging.getLogger("radixserve.router").warning(
            "radixserve router (%s) on http://%s:%d over %d workers", args.policy.policy, host, port,
            len(router.workers))
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
    return 0
