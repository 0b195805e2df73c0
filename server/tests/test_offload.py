"""Big request preparation runs off the event loop, checked with events instead of clocks:
a tokenizer or chat template that blocks until the loop itself releases it can only finish
if the loop is free while it runs; a big JSON body must never be parsed in this process."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from radixserve_server import chat as chat_mod
from radixserve_server import errors as errors_mod
from radixserve_server import http_io
from radixserve_server.app import INLINE_LIMIT, HTTPArgs, ServerState
from radixserve_server.http_io import BIG_JSON_BYTES, read_json, tokenize


class GatedTokenizer:
    """``encode`` and ``apply_chat_template`` announce themselves and wait for the loop."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_while_running: list[bool] = []
        self.threads: list[str] = []

    def _gate(self) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        self.released_while_running.append(self.release.wait(5))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._gate()
        return [1] * 3

    def apply_chat_template(self, messages, **kwargs) -> str:
        self._gate()
        return "".join(m["content"] for m in messages)


class PassGen:
    """The length checks of a generator that accepts everything."""

    def check_text_length(self, text: str, param: str) -> None:
        pass

    def check_ids(self, ids, param: str):
        return ids


def make_state(tokenizer) -> ServerState:
    return ServerState(SimpleNamespace(info={}), tokenizer, HTTPArgs(), "m", {})


async def release_from_loop(tok: GatedTokenizer, work) -> object:
    """Start ``work``; once the tokenizer is inside it, release it from this loop."""
    task = asyncio.ensure_future(work)
    await asyncio.wait_for(asyncio.to_thread(tok.entered.wait, 10), 15)
    tok.release.set()
    return await task


def test_big_texts_are_tokenised_on_the_work_pool():
    tok = GatedTokenizer()
    state = make_state(tok)
    try:
        ids = asyncio.run(release_from_loop(tok, tokenize(state, PassGen(), ["x" * (INLINE_LIMIT + 1)], ["prompt"])))
    finally:
        state.pool.close()
    assert ids == [[1, 1, 1]]
    assert tok.released_while_running == [True], "the tokenizer ran on the event loop"
    assert tok.threads[0].startswith("radixserve-prep"), tok.threads


def test_small_texts_stay_on_the_loop():
    tok = GatedTokenizer()
    tok.release.set()
    state = make_state(tok)
    try:
        asyncio.run(tokenize(state, PassGen(), ["short"], ["prompt"]))
    finally:
        state.pool.close()
    assert tok.threads == [threading.main_thread().name]


def test_big_chat_templates_render_on_the_work_pool():
    tok = GatedTokenizer()
    state = make_state(tok)
    body = SimpleNamespace(continue_final_message=False, generation_prompt=True, tools=None)
    messages = [{"role": "user", "content": "y" * (INLINE_LIMIT + 1)}]
    try:
        text = asyncio.run(release_from_loop(
            tok, state.offload(INLINE_LIMIT + 1, chat_mod.render_chat, tok, body, messages, {})))
    finally:
        state.pool.close()
    assert text == messages[0]["content"]
    assert tok.released_while_running == [True], "the chat template ran on the event loop"


class FakeRequest:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.headers = {"content-length": str(len(raw))}

    async def stream(self):
        for i in range(0, len(self.raw), 2**16):
            yield self.raw[i:i + 2**16]


def test_big_json_bodies_are_parsed_in_the_helper_process(monkeypatch):
    body = {"prompt": "z" * (BIG_JSON_BYTES + 10), "max_tokens": 4}
    raw = json.dumps(body).encode()
    real = json.loads

    def loads_here(s, *a, **kw):
        if len(s) > BIG_JSON_BYTES:
            raise AssertionError("a big body was parsed in the server process")
        return real(s, *a, **kw)

    state = make_state(None)
    monkeypatch.setattr(http_io.json, "loads", loads_here)
    try:
        value = asyncio.run(read_json(FakeRequest(raw), state))
        with pytest.raises(errors_mod.APIError) as e:
            asyncio.run(read_json(FakeRequest(b"[" + b" " * (BIG_JSON_BYTES + 1)), state))
    finally:
        monkeypatch.undo()
        state.json_process.close()
        state.pool.close()
    assert value == body
    assert e.value.status == 400 and e.value.code == "invalid_json", e.value
