"""``/tokenize``, ``/detokenize`` and ``/get_model_info`` on the default model (GGUF, with a
chat template), their errors, and big inputs tokenised off the event loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from radixserve_server.app import INLINE_LIMIT, HTTPArgs, ServerState, create_app
from test_offload import GatedTokenizer, release_from_loop

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
VOCAB = 49152  # SmolLM2's


def test_tokenize_matches_what_generation_sees(idle_after):
    with idle_after.client() as c:
        text = "The capital of France is"
        r = c.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 4096
        assert len(out["token_strs"]) == out["count"] and "France" in "".join(out["token_strs"])
        usage = c.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["usage"]
        assert usage["prompt_tokens"] == out["count"]
        back = c.post("/detokenize", json={"tokens": out["tokens"]}).json()
        assert back == {"prompt": text, "text": text}
        # messages: rendered as the chat route renders them (generation prompt included)
        chat = c.post("/tokenize", json={"messages": MESSAGES, "model": "SmolLM2-135M-Instruct.Q4_1"}).json()
        usage = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
        assert chat["count"] == usage["prompt_tokens"]
        bare = c.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
        assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
        assert "assistant" in c.post("/detokenize", json={"tokens": chat["tokens"][bare["count"]:]}).json()["text"]
        # tools: described in the prompt (this template ignores them) exactly as the chat route does
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        for choice in ("auto", "none"):
            with_tools = c.post("/tokenize", json={"messages": MESSAGES, "tools": tools, "tool_choice": choice}).json()
            usage = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools, "tool_choice": choice,
                                                         "max_tokens": 1}).json()["usage"]
            assert with_tools["count"] == usage["prompt_tokens"], choice
            assert (with_tools["count"] > chat["count"]) == (choice == "auto"), choice


def test_batches(idle_after):
    with idle_after.client() as c:
        out = c.post("/tokenize", json={"prompt": ["a b", "hello world again"]}).json()
        assert out["count"] == [len(t) for t in out["tokens"]] and len(out["count"]) == 2
        back = c.post("/detokenize", json={"tokens": out["tokens"]}).json()
        assert back["text"] == back["prompt"] == ["a b", "hello world again"]
        assert c.post("/detokenize", json={"tokens": []}).json()["text"] == ""


def test_errors_name_the_field(idle_after):
    with idle_after.client() as c:
        def error(path, body, status=400):
            r = c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            return r.json()["error"]["param"]

        assert error("/tokenize", {"prompt": "a", "messages": MESSAGES}) == "prompt"
        assert error("/tokenize", {}) == "prompt"
        assert error("/tokenize", {"prompt": 5}) == "prompt"
        assert error("/tokenize", {"prompt": []}) == "prompt"
        assert error("/tokenize", {"prompt": "a", "add_generation_prompt": True}) == "add_generation_prompt"
        assert error("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}) == "add_special_tokens"
        assert error("/tokenize", {"messages": [{"role": "user"}]}) == "messages[0].content"
        assert error("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}) == "messages[0].role"
        assert error("/tokenize", {"prompt": "a", "bogus": 1}) == "bogus"
        assert error("/tokenize", {"prompt": "a", "model": "other"}, 404) == "model"
        assert error("/detokenize", {"tokens": [1, VOCAB]}) == "tokens"
        assert error("/detokenize", {"tokens": [[1], [-1]]}) == "tokens"
        assert error("/detokenize", {"tokens": "1 2"}) == "tokens"
        assert error("/detokenize", {"tokens": [1, True]}) == "tokens"
        assert error("/detokenize", {}) == "tokens"


def test_get_model_info(idle_after):
    with idle_after.client() as c:
        info = c.get("/get_model_info").json()
        assert info["model_path"].endswith(".gguf") and info["tokenizer_path"] == info["model_path"]
        assert info["is_generation"] is True
        assert info["preferred_sampling_params"] is None  # a GGUF file has no generation_config.json
        assert info["architectures"] == ["LlamaForCausalLM"]
        assert info["weight_version"] == "default"  # SGLang's value for weights never updated


def test_priority_is_ignored_without_priority_scheduling(idle_after):
    with idle_after.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 3})
        assert r.status_code == 200, r.text
        assert c.get("/get_server_info").json()["stats"]["num_preemptions"] == 0


def test_big_tokenize_runs_off_the_event_loop():
    """A big prompt's tokenizer and a big chat's template run on the work pool: a tokenizer
    that waits for the loop to release it finishes only if the loop is free meanwhile."""
    async def post(tok, body):
        client = SimpleNamespace(info={"context_length": 64, "vocab_size": 8}, alive=True, error=None)
        state = ServerState(client, tok, HTTPArgs(), "m", {})
        state.generator = SimpleNamespace(context_length=64, vocab_size=8)
        state.status = "ready"
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return await release_from_loop(tok, c.post("/tokenize", json=body))
        finally:
            state.pool.close()

    big = "x" * (INLINE_LIMIT + 1)
    for body in ({"prompt": big}, {"messages": [{"role": "user", "content": big}]}):
        tok = GatedTokenizer()
        r = asyncio.run(post(tok, body))
        assert r.status_code == 200, r.text
        assert tok.released_while_running[0] is True, f"{list(body)[0]}: templated or tokenised on the loop"
        assert all(name.startswith("radixserve-prep") for name in tok.threads), tok.threads
