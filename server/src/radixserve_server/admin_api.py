"""Health, metrics and admin routes: ``/health``, ``/health_generate``, ``/metrics``,
``/flush_cache``, ``/abort_request``, the expert distribution recorder, ``/debug/check_idle``,
``/load_lora_adapter`` and ``/unload_lora_adapter``.

The routes that change state take POST only (a GET, which a link, a prefetch or a crawler can
send, answers 405); SGLang's clients (its frontend's ``flush_cache``, its router's cache flush)
POST them. With ``--admin-api-key`` they take that key (see :class:`radixserve_server.app.Guard`)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixserve_server.generation import (
    SeqSpec,
)
from radixserve_server.http_io import (
    new_id,
    read_json,
)
from radixserve_server.protocol import (
    APIError,
)
from radixserve_server.state import ServerState

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT = 60.0


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    """Register the health, metrics and admin routes on ``app``."""
    @app.get("/health")
    async def health():
        if state.status != "ready" or not state.client.alive:
            return JSONResponse({"status": "failed" if state.client.failure else state.status,
                                 "reason": state.not_ready_reason()}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if state.status != "ready" or not state.client.alive:
            return JSONResponse({"status": "failed" if state.client.failure else state.status,
                                 "reason": state.not_ready_reason()}, status_code=503)
        gen = state.generator
        token = state.tokenizer.hf.bos_token_id
        specs = [SeqSpec(new_id("health"), [token if token is not None else 0],
                         {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True})
                 for _ in range(state.engine_args.get("dp_size") or 1)]
        if len(specs) > 1:  # --dp-size: one probe per replica
            for i, spec in enumerate(specs):
                state.client.pin(spec.rid, i)
        try:  # a probe: not counted as traffic in /metrics, not aborted by abort_all
            results = await asyncio.wait_for(gen.collect(specs, probe=True), HEALTH_TIMEOUT)
        except (APIError, asyncio.TimeoutError) as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e) or type(e).__name__}, status_code=503)
        if any(len(r.ids) != 1 for r in results):
            return JSONResponse({"status": "unhealthy", "reason": "no token generated"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.status == "ready" and state.client.alive:
            try:
                stats = await state.client.call("get_stats", timeout=5.0)
                if isinstance(stats, dict) and "error" not in stats:
                    state.metrics.set_engine_stats(stats)
            except (asyncio.TimeoutError, RuntimeError):
                pass
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache():
        await state.accepting()
        ok = await state.client.call("flush_cache", timeout=30.0)
        if not ok:
            raise APIError(400, "cannot flush the cache while requests are running; retry when idle",
                           code="busy")
        return {"success": True, "message": "cache flushed"}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """SGLang's ``{"lora_name": NAME, "lora_path": PATH}``: load a PEFT adapter at run time."""
        return await _lora(request, "load_lora_adapter", ("lora_name", "lora_path"))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        """SGLang's ``{"lora_name": NAME}``: refused (400) while queued or running requests use it."""
        return await _lora(request, "unload_lora_adapter", ("lora_name",))

    async def _lora(request: Request, call: str, fields: tuple[str, ...]) -> dict:
        await state.accepting()
        data = await read_json(request, state)
        if not isinstance(data, dict):
            raise APIError(400, f"the body must be a JSON object with {' and '.join(fields)}")
        for f in fields:
            if not isinstance(data.get(f), str) or not data[f]:
                raise APIError(400, f"{f} must be a non-empty string", param=f)
        answer = await state.client.call(call, timeout=120.0, args=tuple(data[f] for f in fields))
        if answer.pop("bad_request", False):
            raise APIError(400, answer["error_message"], param="lora_name")
        if "error" in answer:
            raise APIError(500, answer["error"])
        state.lora_adapters = dict(answer["loaded_adapters"])
        return answer

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """SGLang's abort: ``{"rid": ID}`` aborts the request whose id is exactly ID (with
        all its sequences: a rid given ``n`` or several prompts aborts every one);
        ``{"abort_all": true}`` aborts every running request."""
        data = await read_json(request, state)
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object with rid or abort_all")
        abort_all = data.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise APIError(400, "abort_all must be true or false", param="abort_all")
        rid = data.get("rid")
        gen = state.generator
        if abort_all:
            aborted = gen.abort_all() if gen is not None else []
            return {"success": True, "aborted": aborted}
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "rid must be a request id string (or pass abort_all: true)", param="rid")
        aborted = gen.abort(rid) if gen is not None else []
        return {"success": bool(aborted), "aborted": aborted}

    async def expert_distribution(action: str) -> dict:
        await state.accepting()
        reply = await state.client.call(f"{action}_expert_distribution_record", timeout=60.0)
        if isinstance(reply, dict) and reply.get("bad_request"):
            raise APIError(400, reply["error"], code="no_moe_layers")
        if not isinstance(reply, dict) or "error" in reply:
            raise APIError(500, f"expert distribution {action} failed: {reply}")
        return reply

    @app.post("/start_expert_distribution_record")
    async def start_expert_distribution_record():
        """MoE models: begin recording the expert load (see --expert-distribution-recorder-mode)."""
        await expert_distribution("start")
        return {"success": True, "message": "recording the expert distribution"}

    @app.post("/stop_expert_distribution_record")
    async def stop_expert_distribution_record():
        await expert_distribution("stop")
        return {"success": True, "message": "expert distribution recording stopped"}

    @app.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record():
        """Write the recording as JSON in --expert-distribution-recorder-dir; returns its path."""
        reply = await expert_distribution("dump")
        return {"success": True, "path": reply["path"]}

    @app.get("/debug/check_idle")
    async def check_idle():
        """The engine's leak invariant: null when every KV page is free or cached."""
        await state.accepting()
        return {"problem": await state.client.call("check_idle", timeout=30.0)}
