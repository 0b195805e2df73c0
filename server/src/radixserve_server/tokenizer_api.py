"""``POST /tokenize`` and ``POST /detokenize`` (vLLM and SGLang shapes).

``/tokenize`` takes a ``prompt`` (a string, or SGLang's list of strings) or chat
``messages``, which are rendered exactly as ``/v1/chat/completions`` renders them
(``add_generation_prompt``, ``continue_final_message``, ``tools``,
``chat_template_kwargs``, checked by the same rules). ``add_special_tokens`` defaults to
true for a prompt and false for messages (the template writes its own). The answer is
``{"tokens", "count", "max_model_len"}``, with ``token_strs`` when ``return_token_strs``.
``/detokenize`` takes ``tokens`` (a list of ids, or a list of lists) and answers the text
under both names, vLLM's ``prompt`` and SGLang's ``text``. Big inputs are templated,
tokenised and decoded on the server's work pool, off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from radixserve_server.chat import chat_prompt_text, chat_size
from radixserve_server.http_io import encode_texts, read_request
from radixserve_server.protocol import APIError, ChatCompletionRequest, parse

# /tokenize fields that go to the chat route's body when tokenising messages
CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "tool_choice",
               "chat_template_kwargs")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[Any] | None = None  # validated as the chat route's messages
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] | list[list[int]]


def _decode_all(tokenizer, seqs: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in seqs]


def add_tokenizer_routes(app: FastAPI, state) -> None:
    """Register the routes on ``app`` (``state``: the app's ServerState)."""
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_request(request, state, TokenizeRequest)
        gen = await state.accepting()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        single = True
        if body.messages is not None:
            chat = parse(ChatCompletionRequest, {name: getattr(body, name) for name in CHAT_FIELDS
                                                 if getattr(body, name) is not None})
            chat.check(reserved=set(getattr(state.tokenizer, "special_tokens_map", None) or {}))
            texts = [await state.offload(chat_size(chat), chat_prompt_text, state.tokenizer, chat,
                                         state.tool_calling(chat))]
            add_special = bool(body.add_special_tokens)
        else:
            for name in CHAT_FIELDS[1:]:
                if getattr(body, name) is not None:
                    raise APIError(400, f"{name} applies to messages, not to a prompt", param=name)
            single = isinstance(body.prompt, str)
            texts = [body.prompt] if single else body.prompt
            limit = state.http.max_batch_prompts
            if not texts or len(texts) > limit:
                raise APIError(400, f"prompt has {len(texts)} prompts; give 1 to {limit} (--max-batch-prompts)",
                               param="prompt")
            add_special = body.add_special_tokens is not False
        seqs = await state.offload(sum(len(t) for t in texts), encode_texts, state.tokenizer, texts, add_special)
        outs = []
        for ids in seqs:
            out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": gen.context_length}
            if body.return_token_strs:
                out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
            outs.append(out)
        if single:
            return outs[0]
        return {key: [o[key] for o in outs] if key != "max_model_len" else gen.context_length for key in outs[0]}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_request(request, state, DetokenizeRequest)
        gen = await state.accepting()
        state.check_model(body.model)
        single = not body.tokens or isinstance(body.tokens[0], int)
        seqs = [body.tokens] if single else body.tokens
        for k, ids in enumerate(seqs):
            bad = next((t for t in ids if not 0 <= t < gen.vocab_size), None)
            if bad is not None:
                where = "tokens" if single else f"tokens[{k}]"
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary [0, {gen.vocab_size})",
                               param="tokens")
        texts = await state.offload(sum(len(ids) for ids in seqs), _decode_all, state.tokenizer, seqs)
        text: str | list[str] = texts[0] if single else texts
        return {"prompt": text, "text": text}
