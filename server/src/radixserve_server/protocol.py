"""Request bodies of the OpenAI-compatible and native endpoints, and their errors.

Bodies are validated with pydantic in strict mode (``"0.5"`` is not a number; unknown
fields are ignored, as OpenAI clients and chat UIs send extras). Every failure becomes
an :class:`APIError`, answered with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from radixserve.sampling import InvalidSamplingParams, SamplingParams

# OpenAI field -> SGLang sampling parameter; the reverse names errors in the caller's terms.
OPENAI_TO_SGLANG = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "top_logprobs": "top_logprobs_num",
}
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "model"}


def from_validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = []
    for x in err.get("loc", ()):
        x = str(x)
        if "[" in x or x.startswith("function-") or x in _TYPE_TAGS:
            break  # pydantic's union-member tags, not field names
        loc.append(x)
    param = ".".join(loc) or None
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
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, name, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None

    def flat(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for i, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content part type {part.type!r} is not supported "
                                   "(only text)", param=f"messages.content.{i}.type")
                texts.append(part.text)
            d["content"] = "".join(texts)
        elif self.content is None:
            d["content"] = ""
        return d


class _SamplingFields(_Body):
    """Sampling fields shared by both OpenAI endpoints (OpenAI names, then SGLang extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
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
    rid: str | None = None

    def sampling_params(self) -> dict[str, Any]:
        """SGLang-named sampling parameters (max_new_tokens left to the caller)."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        p: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                     "skip_special_tokens", "no_stop_trim"):
            value = getattr(self, name)
            if value is not None:
                p[name] = value
        if self.min_tokens is not None:
            p["min_new_tokens"] = self.min_tokens
        p.update(grammar_params(self))
        return p


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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(_Body):
    """SGLang's native ``/generate`` body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None


def parse(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
