"""The server's one state object: the engine client, the tokenizer, the flags, readiness,
the work pool for big CPU jobs, metrics and sessions. Every route module takes it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from radixserve.config.lora import lora_name_and_path
from radixserve.secrets import redact_url

from radixserve_server.engine_client import EngineClient
from radixserve_server.generation import (
    Generator,
    SeqSpec,
)
from radixserve_server.http_args import HTTPArgs
from radixserve_server.http_io import (
    JsonProcess,
    WorkPool,
)
from radixserve_server.metrics import Metrics
from radixserve_server.protocol import (
    APIError,
    ChatCompletionRequest,
)
from radixserve_server.sessions import Sessions
from radixserve_server.tool_calling import ToolCalling

logger = logging.getLogger(__name__)
request_log = logging.getLogger("radixserve.requests")

INLINE_LIMIT = 8192  # bodies (bytes) and texts (characters) this small are handled on the loop


class ServerState:
    """What every handler needs; ``status`` is starting, ready, draining or failed."""

    def __init__(self, client: EngineClient, tokenizer, http: HTTPArgs, model_name: str,
                 engine_args: dict[str, Any]) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.http = http
        self.model_name = model_name
        self.engine_args = engine_args
        self.metrics = Metrics(model_name)
        self.status = "starting"
        self.generator: Generator | None = None
        self.created = int(time.time())
        self.pool = WorkPool()
        self.json_process = JsonProcess()
        self.reasoning = None  # radixserve.reasoning.ReasoningSpec of --reasoning-parser (set by launch)
        self._backends: dict[str, Any] | None = None
        self.sessions = Sessions()
        # LoRA adapters by name (--lora-paths; /load_lora_adapter adds): the OpenAI routes' `model`
        self.lora_adapters: dict[str, str] = dict(lora_name_and_path(s) for s in engine_args.get("lora_paths") or ())
        self._ready = asyncio.Event()
        client.on_update = None

    def tool_calling(self, body: ChatCompletionRequest) -> ToolCalling:
        """A chat request's tool calling under this server's --tool-call-* flags."""
        return ToolCalling(body, self.http.tool_call_parser, self.http.tool_call_max_string_length)

    async def offload(self, size: int, fn, *args):
        """``fn(*args)`` on the work pool when ``size`` (bytes or characters) is big, else here."""
        if size <= INLINE_LIMIT:
            return fn(*args)
        return await self.pool.run(fn, *args)

    def mark_ready(self) -> None:
        self.generator = Generator(self.client, self.tokenizer, self.metrics, self.client.info)
        self.status = "ready"
        self._ready.set()

    def mark_failed(self) -> None:
        self.status = "failed"
        self._ready.set()

    async def accepting(self) -> Generator:
        """The generator, once the engine is up; 503 while draining or after a failure."""
        if self.status == "starting":
            await self._ready.wait()
        if self.status == "draining":
            raise APIError(503, "the server is shutting down")
        if self.status != "ready" or self.generator is None or not self.client.alive:
            raise APIError(503, f"the engine is not running: {self.client.error or self.status}")
        return self.generator

    def not_ready_reason(self) -> str:
        failure = self.client.failure  # also right after a death the reader has not reported yet
        if failure:
            return redact_url(failure)
        if self.status == "starting":
            return "the engine is loading the model"
        if self.status == "draining":
            return "the server is shutting down"
        return f"the engine is not running ({self.status})"

    @property
    def speculative(self) -> bool:
        """Whether the engine decodes speculatively (``--speculative-algorithm``)."""
        return bool((self.client.info or {}).get("speculative_algorithm"))

    def resolved_backends(self) -> dict[str, Any]:
        """The backends the engine runs with, where the flags left the choice to it: the
        attention backend of each phase, and the grammar backend (``"none"`` when structured
        output is off). Resolved the way the engine resolves them, from the same registry."""
        if self._backends is None:
            info = self.client.info or {}
            prefill, decode = info.get("prefill_attention_backend"), info.get("decode_attention_backend")
            self._backends = {
                "prefill_attention_backend": prefill, "decode_attention_backend": decode,
                "attention_backend": prefill if prefill == decode else self.engine_args.get("attention_backend"),
                "grammar_backend": info.get("grammar_backend")}
        return self._backends

    def check_dp_rank(self, rank: int | None) -> int | None:
        """SGLang's ``routed_dp_rank``: a replica of ``--dp-size`` (0 when there is one)."""
        if rank is None:
            return None
        size = self.engine_args.get("dp_size") or 1
        if not 0 <= rank < size:
            raise APIError(400, f"routed_dp_rank must be in [0, {size}) (--dp-size {size}), got {rank}",
                           param="routed_dp_rank")
        return rank

    def log_request(self, route: str, specs: list[SeqSpec], texts: list[str] | None = None) -> None:
        """``--log-requests``: one line per request; ``--log-requests-level`` 1 adds the sampling
        parameters, 2 the first 256 characters of the prompt, 3 all of it."""
        level = self.http.log_requests_level
        parts = [f"{route} rid={specs[0].rid} sequences={len(specs)} prompt_tokens={len(specs[0].input_ids)}"]
        if level >= 1:
            parts.append(f"sampling_params={specs[0].params}")
        if level >= 2 and texts:
            text = texts[0] if level >= 3 else texts[0][:256]
            parts.append(f"text={text!r}")
        request_log.info(" ".join(parts))

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter an OpenAI body's ``model`` names (``ADAPTER`` or ``BASE:ADAPTER``), or None
        for the base model; a 404 for anything else."""
        if name is None or name in (self.model_name, self.engine_args.get("model")):
            return None
        adapter = name.split(":", 1)[1] if name.startswith(f"{self.model_name}:") else name
        if adapter in self.lora_adapters:
            return adapter
        served = ", ".join([self.model_name, *self.lora_adapters])
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------- helpers
