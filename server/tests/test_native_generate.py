"""SGLang's native ``/generate`` answers and worker endpoints: streamed ``meta_info`` chunk by
chunk, logprob entries with text, scoring with ``max_new_tokens: 0``, sessions, and SGLang's
endpoint names."""

from __future__ import annotations

import json


def stream(c, body: dict) -> list[dict]:
    out = []
    with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                out.append(json.loads(line[5:]))
    return out


def test_streamed_meta_info_is_real_in_every_chunk(idle_after):
    with idle_after.client() as c:
        prompt = "The history of bread is long. " * 8
        c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 0}})  # cache it
        chunks = stream(c, {"text": prompt + "Bread", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                           "ignore_eos": True}})
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 6} and final["completion_tokens"] == 6
    last_e2e = 0.0
    for ch in chunks:
        meta = ch["meta_info"]
        assert meta["prompt_tokens"] == final["prompt_tokens"] > 40
        assert meta["cached_tokens"] == final["cached_tokens"] > 30
        assert meta["completion_tokens"] == len(ch["output_ids"]) >= 1
        assert meta["first_token_latency"] > 0.0 and meta["e2e_latency"] >= meta["first_token_latency"]
        assert meta["e2e_latency"] >= last_e2e
        last_e2e = meta["e2e_latency"]
        assert (meta["finish_reason"] is None) == (ch is not chunks[-1])


def test_logprob_entries_carry_text_and_scoring_returns_prompt_logprobs(idle_after):
    with idle_after.client() as c:
        out = c.post("/generate", json={"text": "Paris is the capital of", "return_logprob": True,
                                        "return_text_in_logprobs": True, "top_logprobs_num": 2,
                                        "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
        score = c.post("/generate", json={"text": ["The sky is blue", "The sky is green"], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 0}}).json()
        tokens = c.post("/tokenize", json={"prompt": "The sky is blue"}).json()["tokens"]
    meta = out["meta_info"]
    for lp, tid, text in meta["output_token_logprobs"]:
        assert lp <= 0 and text == c_text(idle_after, tid)
    assert all(len(top) == 2 and all(isinstance(e[2], str) for e in top) for top in meta["output_top_logprobs"])
    for s in score:
        m = s["meta_info"]
        assert m["output_token_logprobs"] == []  # nothing generated, still present
        assert m["input_token_logprobs"][0][0] is None  # from position 0: nothing predicts the first token
    assert [t for _, t, _ in score[0]["meta_info"]["input_token_logprobs"]] == tokens
    blue, green = (sum(lp for lp, _, _ in s["meta_info"]["input_token_logprobs"][1:]) for s in score)
    assert blue > green


def c_text(server, tid: int) -> str:
    with server.client() as c:
        return c.post("/detokenize", json={"tokens": [tid]}).json()["text"]


def test_session_continues_a_finished_request(idle_after):
    with idle_after.client() as c:
        sid = c.post("/open_session", json={"capacity_of_str_len": 1000}).json()
        first = c.post("/generate", json={"text": "Alice has three apples.", "rid": "turn-1",
                                          "session_params": {"id": sid},
                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
        second = c.post("/generate", json={"text": " Bob has", "rid": "turn-2",
                                           "session_params": {"id": sid, "rid": "turn-1"},
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
        bad = c.post("/generate", json={"text": "x", "session_params": {"id": sid, "rid": "nope"}})
        assert c.post("/close_session", json={"session_id": sid}).status_code == 200
        gone = c.post("/generate", json={"text": "x", "session_params": {"id": sid}})
    first_len = first["meta_info"]["prompt_tokens"] + 4
    assert second["meta_info"]["prompt_tokens"] > first_len  # history plus its own tokens
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_params.rid"
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "session_params.id"


def test_sglang_endpoint_names(server):
    with server.client() as c:
        info = c.get("/server_info").json()
        assert info == {**info, "tp_size": 1, "dp_size": 1, "disaggregation_mode": "null"}
        assert info["max_total_num_tokens"] > 0 and info["page_size"] >= 1
        assert c.get("/get_server_info").json()["served_model_name"] == info["served_model_name"]
        model = c.get("/model_info").json()
        assert model["served_model_name"] == info["served_model_name"] and model["is_generation"]
        assert c.get("/get_model_info").json()["model_path"] == model["model_path"]
        load = c.get("/get_load").json()
        assert load[0]["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
        missing = c.get("/no/such/route")
        assert missing.status_code == 404 and "/no/such/route" in missing.json()["error"]["message"]
        assert c.post("/start_profile").status_code == 400
        bad_rank = c.post("/generate", json={"text": "x", "routed_dp_rank": 3})
        assert bad_rank.status_code == 400 and bad_rank.json()["error"]["param"] == "routed_dp_rank"
        ok = c.post("/generate", json={"text": "x", "routed_dp_rank": 0, "bootstrap_room": 7, "model": "any",
                                       "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200, ok.text
