"""Tokenizer and chat template from the checkpoint (GGUF metadata or tokenizer files).

Tokenisation goes through a Hugging Face fast tokenizer built from the checkpoint; chat
templates are rendered here in a sandboxed jinja2 environment so ``--chat-template`` and
the server share one renderer.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The chat template could not be rendered for these messages."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template does not compile: {e}") from e


class Tokenizer:
    """Encode/decode and chat templating for one checkpoint."""

    def __init__(self, hf_tokenizer, chat_template: str | None) -> None:
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        self.vocab_size = len(hf_tokenizer)
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.special_tokens_map = {k: v for k, v in hf_tokenizer.special_tokens_map.items() if isinstance(v, str)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        if not self.chat_template:
            raise TemplateError("this model has no chat template; pass --chat-template")
        context = dict(self.special_tokens_map)
        context.update(kwargs)
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **context)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render the template, then tokenize without adding special tokens a second time."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _read_template_override(value: str) -> str:
    if os.path.exists(value):
        with open(value) as fh:
            text = fh.read()
        if value.endswith(".json"):
            text = json.loads(text).get("chat_template", text)
        return text
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor jinja template text")


def load_tokenizer(directory: str, gguf_file: str | None = None, chat_template: str | None = None) -> Tokenizer:
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoTokenizer.from_pretrained(directory, **kwargs)
    template = _read_template_override(chat_template) if chat_template else getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()))
    return Tokenizer(hf, template)
