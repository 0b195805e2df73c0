"""``radixserve router ...``: SGLang's own router (``sglang-router``) in front of radixserve
workers. Every flag is the router's (``python -m sglang_router.launch_router --help``), e.g.

    radixserve router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --policy cache_aware --port 30000

The command only checks that the router is installed and hands over to it (same process).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from radixserve.config import ConfigError

ROUTER_MODULE = "sglang_router.launch_router"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("every flag goes to SGLang's router; see python -m sglang_router.launch_router --help "
                     "(needs pip install sglang-router)")
    parser.set_defaults(accepts_extra_args=True)


def router_argv(extra: list[str]) -> list[str]:
    """The command line that runs SGLang's router with ``extra`` (the flags given to us)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("radixserve router runs SGLang's router, which is not installed: pip install sglang-router")
    return [sys.executable, "-m", ROUTER_MODULE, *extra]


def router_command(ns: argparse.Namespace) -> int:
    argv = router_argv(list(getattr(ns, "extra_args", []) or []))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return 0  # not reached
