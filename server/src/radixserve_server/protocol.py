"""Request bodies of the OpenAI-compatible and native endpoints, and their errors.

Bodies are validated with pydantic in strict mode (``"0.5"`` is not a number). Every
declared field takes effect. The request bodies also take every other field of SGLang's
(:mod:`.sglang_fields`: a no-op, or accepted at its default and refused when set); a field
neither declares nor SGLang knows is a 400 naming it, and so are OpenAI's informational
fields (``user``, ``metadata``, ``safety_identifier``, ``store: false``, ``service_tier:
"auto"|"default"``) never: they change nothing by definition. Every failure becomes an :class:`APIError`, answered
with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``, whose
``code`` is a string or null, never a number.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from radixserve.config.limits import MAX_CACHE_SALT
from radixserve.sampling import InvalidSamplingParams, SamplingParams

from radixserve_server.errors import APIError
from radixserve_server.sglang_fields import GRAMMAR_FIELDS, extras_problem

# OpenAI field -> SGLang sampling parameter; the reverse names errors in the caller's terms.
OPENAI_TO_SGLANG = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "top_logprobs": "top_logprobs_num",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "model"}


def param_path(loc) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"`` (pydantic's union-member
    tags, which are not field names, end the path)."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
            continue
        x = str(x)
        if "[" in x or x.startswith("function-") or x in _TYPE_TAGS:
            break
        out += f".{x}" if out else x
    return out or None


def from_validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    # an unknown field says the most; report it before a type error elsewhere
    err = next((x for x in errors if x.get("type") == "extra_forbidden"), errors[0])
    param = param_path(err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: this field is not supported by this server", param=param,
                        code="unsupported_parameter")
    msg = err.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def from_sampling_error(e: InvalidSamplingParams, names: dict[str, str] | None = None) -> APIError:
    """A sampling-parameter error, naming the field as the caller spelled it."""
    param = e.param
    message = str(e)
    if names and param in names:
        message = message.replace(param, names[param], 1)
        param = names[param]
    return APIError(400, message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _SGLangBody(BaseModel):
    """A request body that also takes SGLang's fields it does not declare (see
    :mod:`.sglang_fields`)."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _sglang_extras(self):
        problem = extras_problem(self.model_extra)
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0], code="unsupported_parameter")
        return self


class PDRoutingFields(_SGLangBody):
    """What SGLang's router adds to a request: the prefill server's bootstrap address and
    room (prefill/decode disaggregation; handed to the engine with the request), and the
    data-parallel replica to run it on (``routed_dp_rank``, or its older name
    ``data_parallel_rank``: a replica of ``--dp-size``)."""

    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    bootstrap_pair_key: str | list[str | None] | None = None
    decode_tp_size: int | list[int | None] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None

    def bootstrap(self, k: int = 0) -> dict[str, Any] | None:
        """The bootstrap fields of prompt ``k`` (a list gives one per prompt); None if unset."""
        out = {}
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"):
            value = getattr(self, name, None)
            if isinstance(value, list):
                if k >= len(value):
                    raise APIError(400, f"{name} has {len(value)} entries, fewer than the prompts", param=name)
                value = value[k]
            if value is not None:
                out[name] = value
        return out or None

    def bootstrap_for(self, n: int, k: int = 0) -> dict[str, Any] | None:
        """:meth:`bootstrap`, refusing ``n > 1``: a bootstrap room carries one sequence."""
        out = self.bootstrap(k)
        if out is not None and n > 1:
            raise APIError(400, f"n = {n} with a bootstrap room: prefill-decode disaggregation carries one "
                                "sequence per room; send n separate requests", param="n")
        return out

    def dp_rank(self) -> int | None:
        """The replica asked for (``routed_dp_rank`` wins over ``data_parallel_rank``)."""
        return self.routed_dp_rank if self.routed_dp_rank is not None else self.data_parallel_rank


class EngineRequestFields(PDRoutingFields):
    """Fields every generation body hands to the engine with each sequence: the
    prefix-cache namespace (vLLM's ``cache_salt``, SGLang's ``extra_key``; both may be
    given, and a request shares cached prefixes only with requests that give the same
    ones), besides the routing fields."""

    cache_salt: str | list[str | None] | None = None
    extra_key: str | list[str | None] | None = None
    # a loaded LoRA adapter's name (one for all prompts, or one per prompt); the OpenAI routes also
    # take it as `model`
    lora_path: str | list[str | None] | None = None

    def lora_of(self, k: int = 0) -> str | None:
        """The adapter prompt ``k`` runs under (None: the base model)."""
        value = self.lora_path
        if isinstance(value, list):
            if k >= len(value):
                raise APIError(400, f"lora_path has {len(value)} entries, fewer than the prompts", param="lora_path")
            value = value[k]
        return value

    def cache_namespace(self, k: int = 0) -> str | None:
        """The namespace of prompt ``k`` (a list gives one per prompt); None: the shared cache."""
        parts = []
        for name in ("cache_salt", "extra_key"):
            value = getattr(self, name)
            if isinstance(value, list):
                if k >= len(value):
                    raise APIError(400, f"{name} has {len(value)} entries, fewer than the prompts", param=name)
                value = value[k]
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_CACHE_SALT):
                raise APIError(400, f"{name} must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                               param=name)
            parts.append(value or "")
        return None if not any(parts) else "\0".join(parts)


class StreamOptions(_Body):
    include_usage: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


ROLES_NEEDING_CONTENT = ("system", "developer", "user", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, name, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None

    def check(self, i: int) -> None:
        """A 400 naming ``messages[i].content`` when the role needs content and has none
        (an assistant message may leave it out only when it carries ``tool_calls``)."""
        if self.content is not None:
            return
        extra = self.model_extra or {}
        if self.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call")):
            return
        why = "an assistant message without tool_calls" if self.role == "assistant" else f"a {self.role} message"
        raise APIError(400, f"messages[{i}].content: {why} needs content (a string or a list of text parts)",
                       param=f"messages[{i}].content")

    def flat(self, i: int) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type {part.type!r} is not supported "
                                   "(only text)", param=f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            d["content"] = "".join(texts)
        elif self.content is None:
            d["content"] = ""
        return d


class _SamplingFields(EngineRequestFields):
    """Sampling fields shared by both OpenAI endpoints (OpenAI names, then SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1)  # at most --max-batch-prompts (checked by the app)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> [-100, 100]; checked by SamplingParams
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    custom_params: dict[str, Any] | None = None
    rid: str | None = None
    priority: int | None = None  # --enable-priority-scheduling: lower values are served first
    # SGLang: the final hidden state of each choice's last token (True) in the choice
    return_hidden_states: bool = False
    session_params: dict[str, Any] | None = None  # sessions are a /generate feature

    def check_max_tokens(self, name: str = "max_tokens") -> None:
        """vLLM's rule on the OpenAI endpoints: ``max_tokens`` (or ``max_completion_tokens``)
        below 1 is a 400; an empty completion is asked for with /generate's ``max_new_tokens: 0``."""
        value = getattr(self, name)
        if value is not None and value < 1:
            raise APIError(400, f"{name} must be at least 1, got {value}", param=name)

    def sampling_params(self) -> dict[str, Any]:
        """SGLang-named sampling parameters (max_new_tokens left to the caller)."""
        p: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                     "skip_special_tokens", "no_stop_trim", "logit_bias", "stop_regex", "custom_params"):
            value = getattr(self, name)
            if value is not None:
                p[name] = value
        if self.min_tokens is not None:
            p["min_new_tokens"] = self.min_tokens
        p.update(grammar_params(self))
        if self.return_hidden_states:
            p["return_hidden_states"] = True
        return p

    def check_sglang(self) -> None:
        if self.session_params is not None:
            raise APIError(400, "session_params: sessions are served on /generate (open one with /open_session)",
                           param="session_params", code="unsupported_parameter")


def grammar_params(body: _SamplingFields) -> dict[str, Any]:
    """The one structured-output constraint of a request (``response_format`` or the native
    ``json_schema``/``regex``/``ebnf`` fields), as sampling parameters."""
    constraints: dict[str, Any] = {}
    given = [name for name in GRAMMAR_FIELDS if getattr(body, name) is not None]
    for name in given:
        value = getattr(body, name)
        if name == "json_schema" and isinstance(value, dict):
            import json

            value = json.dumps(value)
        constraints[name] = value
    rf = body.response_format
    if rf is not None and rf.get("type") != "text":
        try:
            from radixserve.grammar import constraint_from_response_format
        except ImportError:
            raise APIError(400, "response_format is not supported yet by this engine",
                           param="response_format") from None
        try:
            from_rf = constraint_from_response_format(rf)
        except InvalidSamplingParams as e:
            raise from_sampling_error(e) from None
        given += list(from_rf)
        constraints.update(from_rf)
    if len(given) > 1:
        raise APIError(400, f"give at most one structured-output constraint, got {', '.join(given)}"
                       + (" and response_format" if rf is not None and rf.get("type") != "text" else ""),
                       param=given[-1])
    if constraints and not set(constraints) <= set(SamplingParams.field_names()):
        name = next(iter(constraints))
        raise APIError(400, f"{name}: structured output is not supported yet by this engine", param=name)
    return constraints


def constraint_names(body: _SamplingFields) -> dict[str, str]:
    """``{"json_schema": "response_format"}`` when the request's constraint came from
    ``response_format``: errors about it name the field the client sent."""
    rf = body.response_format
    return {"json_schema": "response_format"} if rf is not None and rf.get("type") != "text" else {}


# what the server itself hands the chat template (besides the tokenizer's special tokens);
# chat_template_kwargs may not reuse these names
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "continue_final_message")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tool calling: checked by radixserve_server.tool_calling.check_tools (see check())
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # --reasoning-parser (SGLang's fields): false leaves <think>...</think> in content;
    # false holds the streamed reasoning back until </think> (or the end)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    reasoning_effort: str | None = None  # handed to the chat template (gpt-oss style templates read it)
    # OpenAI's informational fields: accepted, they change nothing by definition
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check(self, reserved: tuple[str, ...] | set[str] = ()) -> None:
        """What pydantic's types cannot say; ``reserved`` are further names the template
        receives from the server (the tokenizer's special tokens)."""
        for i, m in enumerate(self.messages):
            m.check(i)
        self.check_max_tokens("max_tokens")
        self.check_max_tokens("max_completion_tokens")
        self.check_sglang()
        from radixserve_server.tool_calling import check_tools

        check_tools(self)
        if self.store:
            raise APIError(400, "store: storing completions is not supported by this server; omit store or pass false",
                           param="store", code="unsupported_parameter")
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(400, f"service_tier: {self.service_tier!r} is not supported by this server "
                           '(only "auto" and "default")', param="service_tier", code="unsupported_parameter")
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, f"chat_template_kwargs.enable_thinking must be true or false, got {thinking!r}",
                           param="chat_template_kwargs.enable_thinking")
        for key in self.chat_template_kwargs or {}:
            if key in TEMPLATE_ARGUMENTS or key in reserved:
                hint = f"; use the request's {key} field" if key in type(self).model_fields else ""
                raise APIError(400, f"chat_template_kwargs.{key}: the server passes {key} to the chat "
                               f"template itself{hint}", param=f"chat_template_kwargs.{key}")
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message needs an assistant message last "
                               f"(messages[{len(self.messages) - 1}] is {self.messages[-1].role})",
                               param="continue_final_message")

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt as rendered: off when continuing the final message."""
        return False if self.continue_final_message else self.add_generation_prompt


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_max_tokens(self, name: str = "max_tokens") -> None:
        """As on chat, except that with ``echo`` ``max_tokens: 0`` asks for the prompt alone
        (with ``logprobs``, scored: how lm-eval asks for loglikelihoods)."""
        if not (self.echo and getattr(self, name) == 0):
            super().check_max_tokens(name)


class GenerateRequest(EngineRequestFields):
    """SGLang's native ``/generate`` body (its ``GenerateReqInput``). The logprob fields
    and ``return_hidden_states`` take one value for all prompts or a list with one per
    prompt, as SGLang's do."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    top_logprobs_num: int | list[int] | None = None
    logprob_start_len: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    return_hidden_states: bool | Literal["last"] | list[bool | Literal["last"]] = False
    priority: int | None = None  # --enable-priority-scheduling: lower values are served first
    session_params: dict[str, Any] | None = None  # continue a request of a session (/open_session)
    log_metrics: bool = True  # false: not counted in /metrics (SGLang's health probes)
    no_logs: bool = False  # true: not logged by --log-requests

    def per_prompt(self, name: str, k: int, count: int) -> Any:
        """Field ``name`` for prompt ``k`` of ``count`` (a list gives one value per prompt)."""
        value = getattr(self, name)
        if isinstance(value, list):
            if len(value) != count:
                raise APIError(400, f"{name} has {len(value)} entries for {count} prompts", param=name)
            return value[k]
        return value

    def check(self) -> None:
        starts = self.logprob_start_len if isinstance(self.logprob_start_len, list) else [self.logprob_start_len]
        for start in starts:
            if start is not None and start < -1:
                raise APIError(400, "logprob_start_len must be -1 (output tokens only) or a prompt position >= 0, "
                               f"got {start}", param="logprob_start_len")


def parse(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
