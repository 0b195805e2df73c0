"""Rendering a chat request into its prompt text (shared by /v1/chat/completions and /tokenize)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve_server.errors import APIError
from radixserve_server.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from radixserve_server.tool_calling import ToolCalling


def chat_size(body: ChatCompletionRequest) -> int:
    """The characters of a chat request's messages (whether to render it on the work pool)."""
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content)
               for m in body.messages if m.content is not None)


def chat_prompt_text(tokenizer, body: ChatCompletionRequest, tools: ToolCalling) -> str:
    """The prompt text of a chat request, as /v1/chat/completions and /tokenize render it:
    flat messages, the tool round trip made renderable, then the chat template."""
    messages = tools.prepare_messages([m.flat(i) for i, m in enumerate(body.messages)],
                                      getattr(tokenizer, "chat_template", None))
    try:
        kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        return render_chat(tokenizer, body, messages, kwargs)
    except APIError:
        raise
    except ValueError as e:  # TemplateError: a template that raised or is missing
        raise APIError(400, str(e), param="messages") from None


CONTINUE_MARK = "\x00radixserve:continue\x00"


def render_chat(tokenizer, body: ChatCompletionRequest, messages: list[dict[str, Any]],
                kwargs: dict[str, Any]) -> str:
    """The prompt text. With ``continue_final_message`` the template renders without a
    generation prompt and the text is cut right after the final assistant message's
    content, so no end-of-turn token follows and the model continues that message."""
    final = messages[-1]["content"] if body.continue_final_message else None
    if final is not None and not final.strip():
        messages = messages[:-1] + [dict(messages[-1], content=CONTINUE_MARK)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.generation_prompt,
                                         tools=body.tools, **kwargs)
    if final is None:
        return text
    if not final.strip():
        if CONTINUE_MARK not in text:
            raise APIError(400, "continue_final_message: the chat template does not render the final "
                           "message", param="continue_final_message")
        return text[:text.rindex(CONTINUE_MARK)] + final
    for piece in (final, final.strip()):
        if piece in text:
            return text[:text.rindex(piece) + len(piece)]
    raise APIError(400, "continue_final_message: the chat template does not render the final message's "
                   "content verbatim, so it cannot be continued", param="continue_final_message")
