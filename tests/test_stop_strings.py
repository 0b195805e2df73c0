"""Stop strings, exactly: a property test against a reference that decodes the whole output.

Reference: after each token ``k`` the output's final text is ``decode(ids[:k])`` (held back
while it ends in half a character). Generation stops at the first ``k`` whose final text
contains a stop string; the output is that text up to the earliest stop string in it
(whole, with ``no_stop_trim``). The scheduler's check (non-streamed output) and the
streaming detokenizer (deltas held back by the longest stop string) must both give
exactly that, wherever the stop string starts: also inside a token longer than it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.engine.request import Req
from radixserve.engine.scheduler.output import OutputProcessor
from radixserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def tok():
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    ckpt = load_checkpoint(None)
    return load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file)


@pytest.fixture(scope="module")
def pools(tok):
    """Token ids to draw from: common words, long tokens, single bytes and special tokens."""
    words = tok.encode("The quick brown fox jumps over the lazy dog. STOP! ## end\n\n"
                       "数学是科学的语言 🎉 naïve café === >>> ]]", add_special_tokens=False)
    vocab = len(tok.hf)
    lengths = {i: len(tok.decode([i])) for i in range(vocab)}
    long_tokens = sorted(lengths, key=lambda i: -lengths[i])[:200]  # 20+ characters each
    assert long_tokens, "the tokenizer has no long tokens to test with"
    specials = sorted(set(tok.hf.all_special_ids))
    return words, long_tokens, specials, vocab


def reference(tok, ids: list[int], stops: list[str], no_trim: bool, skip: bool):
    """(tokens consumed, output text) by decoding each prefix in full."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        if text.endswith("\ufffd"):
            continue  # half a character: not final yet
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, text if no_trim else text[:min(hits)]
    return len(ids), None


def scheduler_check(tok, ids, stops, no_trim, skip):
    """Run the scheduler's own finish check token by token (non-streamed output)."""
    outputs = OutputProcessor(tok, set(), vocab_size=len(tok.hf), max_running=1, context_len=10**6,
                              kv=None, queues=None, stats=None)
    p = SamplingParams(stop=stops, no_stop_trim=no_trim, skip_special_tokens=skip, ignore_eos=True,
                       max_new_tokens=len(ids) + 1)
    p.verify()
    req = Req("r", [1], p, len(ids) + 1)
    for k, t in enumerate(ids, 1):
        req.output_ids.append(t)
        reason = outputs.finish_reason(req, t)
        if reason is not None:
            assert reason["type"] == "stop" and reason["matched"] in stops
            return k, req.stop_text
    return len(ids), None


def streamed(tok, ids, stops, stop_at, final_text, skip):
    """What a stream shows: deltas while running, then the rest at the finish."""
    d = IncrementalDetokenizer(tok, skip, stops)
    out = []
    for k, t in enumerate(ids[:stop_at], 1):
        d.add([t])
        out.append(d.finish(final_text) if k == stop_at else d.delta())
    return "".join(out)


def token_streams(pools):
    words, long_tokens, specials, vocab = pools
    token = st.one_of(st.sampled_from(words), st.sampled_from(long_tokens), st.sampled_from(specials),
                      st.integers(0, vocab - 1))
    return st.lists(token, min_size=1, max_size=24)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_match_the_reference(tok, pools, data):
    ids = data.draw(token_streams(pools), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    no_trim = data.draw(st.booleans(), label="no_stop_trim")
    full = tok.decode(ids, skip_special_tokens=skip)
    from_text = st.builds(lambda a, n: full[a:a + n], st.integers(0, max(0, len(full) - 1)), st.integers(1, 8))
    stop = st.one_of(from_text, st.text(min_size=1, max_size=4)).filter(bool)
    stops = data.draw(st.lists(stop, min_size=1, max_size=3, unique=True), label="stops")

    k_ref, text_ref = reference(tok, ids, stops, no_trim, skip)
    k, text = scheduler_check(tok, ids, stops, no_trim, skip)
    assert (k, text) == (k_ref, text_ref)
    final = text_ref if text_ref is not None else full
    assert streamed(tok, ids, stops, k_ref, text_ref, skip) == (
        final if text_ref is not None else tok.decode(ids[:k_ref], skip_special_tokens=skip))


def test_a_stop_string_inside_a_long_token_is_found(tok, pools):
    _, long_tokens, _, _ = pools
    t = long_tokens[0]
    piece = tok.decode([t])
    assert len(piece) > 20
    ids = tok.encode("Hello", add_special_tokens=False) + [t]
    stop = piece[1:4]  # starts inside the token, far from the end of the text
    k, text = scheduler_check(tok, ids, [stop], False, True)
    assert k == len(ids) and text == tok.decode(ids)[: tok.decode(ids).find(stop)]


def test_stop_token_text_is_trimmed(default_engine):
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    full = default_engine.generate("The capital of France is", greedy)["output_ids"]
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # a first occurrence
    stop_id = full[k]
    out = default_engine.generate("The capital of France is", {**greedy, "stop_token_ids": [stop_id]})
    tok = default_engine.tokenizer
    assert out["output_ids"] == full[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tok.decode(full[:k])
    kept = default_engine.generate("The capital of France is",
                                   {**greedy, "stop_token_ids": [stop_id], "no_stop_trim": True})
    assert kept["text"] == tok.decode(full[:k + 1])
