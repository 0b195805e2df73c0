"""Registers ``radixserve serve``, ``radixserve router`` and ``radixserve bench`` through the command hook."""

from __future__ import annotations

from radixserve.hookspecs import hookimpl


def _serve(ns):
    from radixserve_server.launch import serve_command

    return serve_command(ns)


def _serve_arguments(parser):
    from radixserve_server.launch import add_arguments

    add_arguments(parser)


def _router(ns):
    from radixserve_server.router.launch import router_command

    return router_command(ns)


def _router_arguments(parser):
    from radixserve_server.router.launch import add_arguments

    add_arguments(parser)


def _bench(ns):
    from radixserve_server.bench import bench_command

    return bench_command(ns)


def _bench_arguments(parser):
    from radixserve_server.bench import add_arguments

    add_arguments(parser)


@hookimpl
def register_commands(register):
    register("serve", _serve, add_arguments=_serve_arguments,
             description="serve a model over HTTP (OpenAI-compatible and native /generate)")
    register("router", _router, add_arguments=_router_arguments,
             description="SGLang's router (sglang-router) over several radixserve servers; all flags are its own")
    register("bench", _bench, add_arguments=_bench_arguments,
             description="benchmark a running OpenAI-compatible server (random, shared-prefix, multi-turn)")
