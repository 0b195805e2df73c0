"""Tokenizer and chat template from the checkpoint (GGUF metadata or tokenizer files).

Tokenisation goes through a Hugging Face fast tokenizer built from the checkpoint; chat
templates are rendered here in a sandboxed jinja2 environment so ``--chat-template`` and
the server share one renderer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
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


def _cache_dir() -> str:
    return os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def _load_gguf_tokenizer(directory: str, gguf_file: str):
    """Build the fast tokenizer from GGUF metadata once, then reuse a saved copy.

    Converting the vocabulary takes seconds; the saved ``tokenizer.json`` is keyed by the
    GGUF file's path, size and modification time, so a changed file converts again.
    """
    from transformers import AutoTokenizer

    path = os.path.abspath(os.path.join(directory, gguf_file))
    st = os.stat(path)
    key = hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    hf = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    tmp = None
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        hf.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # a read-only home or a racing writer: the converted tokenizer still works
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(directory: str, gguf_file: str | None = None, chat_template: str | None = None) -> Tokenizer:
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    if not gguf_file and not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{directory!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                "add one, or pass --tokenizer-path")
    hf = _load_gguf_tokenizer(directory, gguf_file) if gguf_file else AutoTokenizer.from_pretrained(directory)
    template = _read_template_override(chat_template) if chat_template else getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # several named templates: use the default one
        template = template.get("default") or next(iter(template.values()))
    return Tokenizer(hf, template)
