"""The worker endpoints SGLang's clients and router read, under SGLang's current names
(the older ``/get_*`` names answer the same):

- ``GET /server_info`` (``/get_server_info``): the engine's arguments, with SGLang's names
  for what its router reads (``tp_size``, ``dp_size``, ``load_balance_method``,
  ``disaggregation_mode``, ``max_running_requests``, ``max_total_num_tokens``,
  ``page_size``, ...), the resolved backends, live ``internal_states`` and the version; keys
  and other secret arguments show as ``***``, and so do the user and password of every URL.
- ``GET /model_info`` (``/get_model_info``): ``model_path``, ``tokenizer_path``,
  ``served_model_name``, ``is_generation``, ``max_context_length``, ``vocab_size``,
  token ids, ``preferred_sampling_params`` (the sampling defaults in force for fields a
  request leaves out), ``architectures``, ...
- ``GET /get_load`` (and ``/v1/loads``): per replica, running and waiting requests and the
  KV tokens in use, as the router's load-aware policies read them.
- ``POST /open_session`` / ``/close_session``: see :mod:`.sessions`.
- ``/start_profile`` / ``/stop_profile``: a 400: there is no profiler hook here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from radixserve.secrets import redact_args

from radixserve_server.http_io import read_json
from radixserve_server.protocol import APIError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixserve-server")
    except PackageNotFoundError:
        return "unknown"


async def _stats(state) -> dict[str, Any] | None:
    """The engine's live statistics (with ``dp_replicas`` under --dp-size; None while it is not running)."""
    if state.status != "ready" or not state.client.alive:
        return None
    try:
        stats = await state.client.call("get_stats", timeout=5.0)
    except (asyncio.TimeoutError, RuntimeError):
        return None
    if not isinstance(stats, dict) or "error" in stats:
        return None
    return stats


def _replicas(stats: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One statistics dict per replica."""
    if stats is None:
        return []
    replicas = stats.get("dp_replicas")
    return replicas if isinstance(replicas, list) else [stats]


def add_worker_routes(app: FastAPI, state) -> None:
    started = time.time()

    def model_info() -> dict[str, Any]:
        info = state.client.info or {}
        model_path = info.get("model_path") or state.engine_args.get("model")
        hf = getattr(state.tokenizer, "hf", None)
        eos = getattr(state.tokenizer, "eos_token_ids", None) or (
            [hf.eos_token_id] if hf is not None and hf.eos_token_id is not None else [])
        return {
            "model_path": model_path,
            "tokenizer_path": state.engine_args.get("tokenizer_path") or model_path,
            "served_model_name": state.model_name,
            "is_generation": True,
            "max_context_length": info.get("context_length"),
            "max_req_input_len": (info.get("context_length") or 1) - 1,
            "vocab_size": info.get("vocab_size"),
            "eos_token_ids": sorted(eos),
            "bos_token_id": getattr(hf, "bos_token_id", None),
            "pad_token_id": getattr(hf, "pad_token_id", None),
            "preferred_sampling_params": info.get("sampling_defaults"),
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "supports_vision": False,
            "model_type": info.get("model_type"),
            "architectures": [info["architecture"]] if info.get("architecture") else None,
            "reasoning_parser": state.engine_args.get("reasoning_parser"),
            "tool_call_parser": state.http.tool_call_parser,
            "disaggregation_mode": state.engine_args.get("disaggregation_mode") or "null",
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        await state.accepting()
        return model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        stats = await _stats(state)
        info = state.client.info or {}
        http = asdict(state.http)
        args = {**state.engine_args, **state.resolved_backends()}
        return redact_args({
            **args,
            "model_path": info.get("model_path") or args.get("model"),
            "served_model_name": state.model_name,
            "tp_size": args.get("tp_size") or 1,
            "dp_size": args.get("dp_size") or 1,
            "load_balance_method": args.get("load_balance_method") or "round_robin",
            "disaggregation_mode": state.engine_args.get("disaggregation_mode") or "null",
            "max_total_num_tokens": info.get("max_total_tokens"),
            "page_size": info.get("page_size"),
            "max_running_requests": args.get("max_running_requests"),
            "max_prefill_tokens": args.get("max_prefill_tokens"),
            "is_generation": True,
            "architectures": [info["architecture"]] if info.get("architecture") else None,
            "status": state.status, "model": state.model_name,
            "server_args": args, "http_args": http, "engine": info,
            "internal_states": _replicas(stats), "stats": stats,
            "in_flight": state.client.num_in_flight(),
            "startup_time": started, "version": _version(),
        })

    async def loads() -> list[dict[str, Any]]:
        await state.accepting()
        out = []
        for i, s in enumerate(_replicas(await _stats(state))):
            running, waiting = int(s.get("num_running_reqs", 0)), int(s.get("num_waiting_reqs", 0))
            out.append({"dp_rank": i, "num_reqs": running + waiting, "num_running_reqs": running,
                        "num_waiting_reqs": waiting, "num_tokens": int(s.get("num_used_tokens", 0)),
                        "max_total_num_tokens": s.get("max_total_num_tokens"),
                        "token_usage": s.get("token_usage", 0.0)})
        return out

    @app.get("/get_load")
    async def get_load():
        return await loads()

    @app.get("/v1/loads")
    async def v1_loads():
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": _version(),
                "accelerator": None, "num_accelerators": 0, "loads": await loads()}

    @app.post("/open_session")
    async def open_session(request: Request):
        data = await read_json(request, state)
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object with capacity_of_str_len")
        sid = data.get("session_id")
        if sid is not None and (not isinstance(sid, str) or not sid):
            raise APIError(400, "session_id must be a non-empty string", param="session_id")
        return state.sessions.open(sid)

    @app.post("/close_session")
    async def close_session(request: Request):
        data = await read_json(request, state)
        sid = data.get("session_id") if isinstance(data, dict) else None
        if not isinstance(sid, str):
            raise APIError(400, "session_id must be the id /open_session answered", param="session_id")
        state.sessions.close(sid)
        return {"success": True}

    @app.post("/start_profile")
    @app.post("/stop_profile")
    async def profile():
        raise APIError(400, "profiling is not supported by this server: run it under py-spy or "
                       "torch.profiler instead", code="unsupported")
