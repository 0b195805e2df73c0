"""Prompt logprobs (``return_logprob`` with ``logprob_start_len >= 0``).

On a tiny random model, against the engine's own full-prompt logits
(``ModelRunner.prompt_logits``): chunked prefill, a capped prefix-cache match, the per-step
bound on logits rows, retraction, ``max_new_tokens: 0`` and bad start positions. On the
default model, against transformers' ``log_softmax`` of the prompt logits.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import leak_checked_engine
from radixserve.engine.scheduler import RequestRejected
from radixserve.engine.scheduler import kv as kv_mod
from tiny_models import VOCAB, build_checkpoint

# ours vs our own full-prompt logits: the same arithmetic, chunked or not (float32)
SELF_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plp_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


engine_for = leak_checked_engine


def prompts(n: int = 3, length: int = 45, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def params(start: int, top: int = 3, new: int = 4) -> dict:
    return {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True, "return_logprob": True,
            "logprob_start_len": start, "top_logprobs_num": top}


def check_against_logits(engine, ids: list[int], out: dict, start: int, top: int = 3,
                         atol: float = SELF_ATOL) -> None:
    ref = torch.log_softmax(engine.runner.prompt_logits(ids), dim=-1)  # [T, V]
    meta = out["meta_info"]
    tokens = meta["input_token_logprobs"]
    assert [t for _, t in tokens] == ids[start:], "one entry per prompt token from logprob_start_len on"
    for i, (lp, tok) in enumerate(tokens, start=start):
        if i == 0:
            assert lp is None
            continue
        assert lp == pytest.approx(ref[i - 1, tok].item(), abs=atol), f"position {i}"
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(tokens)
        for i, entry in enumerate(tops, start=start):
            if i == 0:
                assert entry is None
                continue
            values, ids_k = ref[i - 1].topk(top)
            assert [v for v, _ in entry] == pytest.approx(values.tolist(), abs=atol)
            assert [t for _, t in entry] == ids_k.tolist()
    else:
        assert "input_top_logprobs" not in meta


@pytest.mark.parametrize(("page_size", "chunk"), [(1, -1), (1, 7), (4, 13)])
def test_prompt_logprobs_over_chunks_and_a_batch(tiny_path, page_size, chunk):
    with engine_for(tiny_path, page_size=page_size, chunked_prefill_size=chunk) as engine:
        ps = prompts()
        plain = engine.generate(input_ids=ps, sampling_params={"temperature": 0.0, "max_new_tokens": 4,
                                                                "ignore_eos": True})
        starts = [0, 5, len(ps[2]) - 1]
        outs = engine.generate(input_ids=ps, sampling_params=[params(s, top=(3, 0, 1)[i])
                                                              for i, s in enumerate(starts)])
        for ids, out, start, top, p in zip(ps, outs, starts, (3, 0, 1), plain):
            check_against_logits(engine, ids, out, start, top)
            assert out["output_ids"] == p["output_ids"]  # the output is unaffected
            assert len(out["meta_info"]["output_token_logprobs"]) == 4


def test_a_cached_prompt_is_recomputed_where_logprobs_are_owed(tiny_path):
    with engine_for(tiny_path, page_size=1) as engine:
        ids = prompts(1)[0]
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # the whole prompt cached
        first = engine.generate(input_ids=ids, sampling_params=params(0))
        assert first["meta_info"]["cached_tokens"] == 0  # position 0 predicts token 1
        check_against_logits(engine, ids, first, 0)
        again = engine.generate(input_ids=ids, sampling_params=params(0))
        assert again["meta_info"]["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]
        assert again["meta_info"]["input_top_logprobs"] == first["meta_info"]["input_top_logprobs"]
        late = engine.generate(input_ids=ids, sampling_params=params(20))
        assert late["meta_info"]["cached_tokens"] == 19  # the match stops before position 19
        check_against_logits(engine, ids, late, 20)
        after = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        assert after["meta_info"]["cached_tokens"] == len(ids) - 1  # plain requests still hit in full


def test_each_step_computes_a_bounded_number_of_logits_rows(tiny_path, monkeypatch):
    with engine_for(tiny_path, chunked_prefill_size=-1) as engine:
        sizes: list[tuple[int, int]] = []  # (requests, logits rows) per forward pass
        original = engine.runner.forward_local

        def spy(batch):
            logits = original(batch)
            sizes.append((batch.batch_size, logits.shape[0]))
            return logits

        monkeypatch.setattr(engine.runner, "forward_local", spy)
        ps = prompts(3)
        engine.generate(input_ids=ps, sampling_params={"max_new_tokens": 2})
        assert all(rows == reqs for reqs, rows in sizes), "no extra logits without prompt logprobs"
        sizes.clear()
        monkeypatch.setattr(engine.scheduler.planner, "prompt_logprob_rows", 10)
        outs = engine.generate(input_ids=ps, sampling_params=[params(0), {"max_new_tokens": 2}, params(3)])
        assert max(rows - reqs for reqs, rows in sizes) <= 10  # so the 44 + 56 rows took 10+ steps
        check_against_logits(engine, ps[0], outs[0], 0)
        check_against_logits(engine, ps[2], outs[2], 3)


def test_max_new_tokens_zero_scores_the_prompt_and_frees_it(tiny_path):
    with engine_for(tiny_path) as engine:
        ids = prompts(1)[0]
        steps = engine.scheduler.stats.num_forward_steps
        plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        assert plain["output_ids"] == [] and plain["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        # prefilled all the same, so its prompt is in the prefix cache (how SGLang's frontend caches a prefix)
        assert engine.scheduler.stats.num_forward_steps > steps
        again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        assert again["meta_info"]["cached_tokens"] >= len(ids) - engine.server_args.page_size
        out = engine.generate(input_ids=ids, sampling_params={**params(0), "max_new_tokens": 0})
        assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert out["meta_info"]["output_token_logprobs"] == []
        check_against_logits(engine, ids, out, 0)
        engine.check_idle_invariant()


def test_retraction_neither_repeats_nor_loses_prompt_logprobs(tiny_path, monkeypatch):
    ps = prompts(4, length=30)
    with engine_for(tiny_path) as roomy:
        want = roomy.generate(input_ids=ps, sampling_params=params(0, new=24))
    # Reserve nothing for future decode tokens, so decode outgrows the pool and must retract;
    # a resumed request (prompt + output) longer than a chunk is prefilled in chunks again.
    monkeypatch.setattr(kv_mod, "INIT_NEW_TOKEN_RATIO", 0.0)
    monkeypatch.setattr(kv_mod, "MIN_NEW_TOKEN_RATIO", 0.0)
    with engine_for(tiny_path, page_size=4, max_total_tokens=192, chunked_prefill_size=32) as engine:
        outs = engine.generate(input_ids=ps, sampling_params=params(0, new=24))
        assert engine.scheduler.stats.num_retractions > 0
    for w, out in zip(want, outs):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert out["output_ids"] == w["output_ids"]
        for key in ("input_token_logprobs", "input_top_logprobs"):
            got, ref = out["meta_info"][key], w["meta_info"][key]
            assert len(got) == len(ref)
            for g, r in zip(got[1:], ref[1:]):
                assert g == pytest.approx(r, abs=SELF_ATOL) if key == "input_token_logprobs" else \
                    [v for v, _ in g] == pytest.approx([v for v, _ in r], abs=SELF_ATOL)


def test_logprob_start_len_must_be_inside_the_prompt(tiny_path):
    with engine_for(tiny_path) as engine:
        with pytest.raises(RequestRejected, match="logprob_start_len") as err:
            engine.generate(input_ids=[5, 6, 7], sampling_params=params(3))
        assert err.value.param == "logprob_start_len"
        # without return_logprob the field is ignored, as in SGLang
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1, "logprob_start_len": 9})
        assert "input_token_logprobs" not in out["meta_info"]


# ------------------------------------------------------------------ the default model
# transformers dequantises the same GGUF file to float32 as test_default_model.py does, whose
# logits agree to LOGITS_RTOL * max(1, max |logit|); a logprob (logit - logsumexp) can be
# off by twice that.
LOGITS_RTOL = 1e-4
TEXT = ("The history of computing is a story of layered abstractions. Early machines were programmed "
        "by rewiring panels of plugs and switches; later, stored programs let the same hardware run many tasks.")


@pytest.mark.slow
def test_default_model_prompt_logprobs_match_transformers(default_engine, hf_default_model, hf_default_tokenizer,
                                                          monkeypatch, assert_idle):
    ids = hf_default_tokenizer.encode(TEXT)
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].float()  # [T, V]
    ref = torch.log_softmax(logits, dim=-1)  # [T, V]
    atol = 2 * LOGITS_RTOL * max(1.0, logits.abs().max().item())
    top = 5

    def check(out, start=0):
        tokens = out["meta_info"]["input_token_logprobs"]
        assert len(tokens) == len(ids) - start and tokens[0] == (None, ids[0])
        got = torch.tensor([lp for lp, _ in tokens[1:]])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (got - want).abs().max().item() <= atol
        for i, entry in enumerate(out["meta_info"]["input_top_logprobs"][1:]):
            values, order = ref[i].topk(top)
            assert [v for v, _ in entry] == pytest.approx(values.tolist(), abs=atol)
            # ids agree unless two candidates are closer than the tolerance
            for (v, t), w in zip(entry, order.tolist()):
                assert t == w or abs(ref[i, t].item() - v) <= 2 * atol

    sp = {"temperature": 0.0, "max_new_tokens": 3, "return_logprob": True, "logprob_start_len": 0,
          "top_logprobs_num": top}
    first = default_engine.generate(TEXT, sp)
    check(first)
    again = default_engine.generate(TEXT, sp)  # the prompt is in the cache now
    assert again["meta_info"]["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]
    monkeypatch.setattr(default_engine.server_args, "chunked_prefill_size", 16)  # 37 tokens: 3 chunks
    chunked = default_engine.generate(TEXT, sp)
    check(chunked)
    assert chunked["output_ids"] == first["output_ids"]
    assert_idle(default_engine)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_n_sequences_compute_prompt_logprobs_once(tiny_path, policy):
    """n = 8 with prompt logprobs: the prompt is prefilled once, and every sequence reports
    the same (correct) prompt logprobs."""
    ids = prompts(1, length=300, seed=3)[0]
    with engine_for(tiny_path, schedule_policy=policy, chunked_prefill_size=128) as engine:
        before = engine.scheduler.stats.num_prefill_tokens
        outs = engine.generate(input_ids=ids, sampling_params={**params(0), "n": 8, "max_new_tokens": 2})
        computed = engine.scheduler.stats.num_prefill_tokens - before
        assert len(ids) <= computed < len(ids) + 8 * 4, f"{computed} prompt tokens computed for n = 8"
        check_against_logits(engine, ids, outs[0], 0)
        for out in outs[1:]:
            assert out["meta_info"]["input_token_logprobs"] == outs[0]["meta_info"]["input_token_logprobs"]
            assert out["meta_info"]["input_top_logprobs"] == outs[0]["meta_info"]["input_top_logprobs"]
            assert out["meta_info"]["cached_tokens"] >= len(ids) - 8
