"""Incremental detokenisation: multi-byte characters and stop strings."""

from __future__ import annotations

import pytest
from radixserve_server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    ckpt = load_checkpoint(None)
    return load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file)


TEXTS = ["héllo wörld — naïve café", "数学是科学的语言。日本語も。", "party 🎉🎉 time 👩‍👩‍👧 ok", "plain ascii text"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_reassembles_the_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = []
    for t in ids:
        d.add([t])
        pieces.append(d.delta())
    pieces.append(d.finish())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character
    if any("\ufffd" in tok.decode([t]) for t in ids):
        # some tokens carry only part of a character: those steps released nothing
        assert "" in pieces[:-1]


def test_stop_string_prefix_is_held_back_until_the_end(tok):
    text = "The answer is 42. STOP here"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=[" STOP"])
    released = ""
    for t in ids:
        d.add([t])
        if " STOP" in d.text:  # the engine finishes on this token and sends the trimmed text
            break
        released += d.delta()
        assert len(released) <= max(0, len(d.text) - 4)  # the last len(" STOP") - 1 chars are held
    # the engine trims at the stop string; what was released is a prefix of the trimmed text
    trimmed = text[:text.index(" STOP")]
    assert trimmed.startswith(released)
    assert released + d.finish(trimmed) == trimmed
