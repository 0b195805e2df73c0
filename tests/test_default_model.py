"""The default GGUF checkpoint (SmolLM2-135M-Instruct, Q4_1) against transformers.

transformers dequantises the same GGUF file to float32; so does our loader, and the
engine runs in float32 on CPU. So logits must agree to float32 rounding and greedy
decoding must produce exactly the same tokens, EOS included (both stop there).

transformers' greedy references are computed once per session, one prompt at a time
(no padding), and compared with the engine run three ways: all prompts in one
``generate`` call, one prompt per call, and all prompts in one call with 16-token pages.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
# max |ours - hf| <= LOGITS_RTOL * max(1, max |hf|): float32 rounding only (both sides
# dequantise with gguf-py and run the same arithmetic up to summation order).
LOGITS_RTOL = 1e-4

_LONG = (
    "The history of computing is a story of layered abstractions. Early machines were "
    "programmed by rewiring panels of plugs and switches; later, stored programs let the "
    "same hardware run many tasks. Assemblers turned mnemonics into machine code, and "
    "compilers turned structured languages into assembly. Operating systems hid devices "
    "behind files and processes, and networks hid distance behind sockets. Each layer "
    "made the one above it simpler to use and harder to see through. Today a programmer "
    "can train a neural network with a few lines of Python, relying on libraries that "
    "call into compiled kernels, which run on accelerators with their own instruction "
    "sets and memory hierarchies. Understanding where time and memory go therefore means "
    "reading down through the layers: from the model definition to the framework, from "
    "the framework to the kernel, and from the kernel to the hardware. Summarise the "
    "main idea of this passage in two sentences:"
)

PLAIN_PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n",
    "```python\nimport numpy as np\n\n# compute the mean of each row\n",
    "Here is a shopping list:\n1. Milk\n2. Eggs\n3.",
    "Question: Why is the sky blue?\nAnswer:",
    "12 + 35 = 47\n81 - 19 = 62\n7 * 8 =",
    "Translate to French: Good morning, how are you?\n",
    "Le petit déjeuner français typique comprend",
    "日本の首都は",
    "Москва — столица",
    "Emoji story: 🐶🏃‍♂️🌳 means",
    "SELECT name, COUNT(*) FROM users",
    "Once upon a time",
    "Pi is approximately 3.14159265",
    "   indented text with\ttabs\n\n",
    _LONG,
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the boiling point of water in Celsius?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "List three fruits."},
     {"role": "assistant", "content": "Apple, banana, cherry."},
     {"role": "user", "content": "Now three vegetables."}],
    [{"role": "user", "content": "Écris une phrase sur le café ☕."}],
]


@pytest.fixture(scope="module")
def prompts(hf_default_tokenizer) -> list[str]:
    chats = [hf_default_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in CHAT_CONVERSATIONS]
    out = PLAIN_PROMPTS + chats
    assert len(out) >= 20
    return out


@pytest.fixture(scope="module")
def hf_greedy(prompts, hf_default_model, hf_default_tokenizer) -> list[list[int]]:
    """transformers' greedy tokens per prompt, ending with EOS when it stopped there."""
    refs = []
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([hf_default_tokenizer.encode(text)])
            out = hf_default_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=NEW_TOKENS)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


@pytest.fixture(scope="module")
def paged_engine():
    import radixserve

    engine = radixserve.Engine(max_total_tokens=16384, page_size=16)
    yield engine
    engine.shutdown()


def _check_logits(engine, model, tokenizer, texts) -> None:
    for text in texts:
        ids = tokenizer.encode(text)
        ours = engine.runner.prompt_logits(ids)  # [T, V]
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()  # [T, V]
        assert ours.shape == ref.shape
        scale = max(1.0, ref.abs().max().item())
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_RTOL * scale, f"{text[:30]!r}: max |diff| {diff:.3g} over {LOGITS_RTOL} * {scale:.3g}"


def _check_outputs(outs, prompts, refs, tokenizer, eos_id, how: str) -> None:
    assert len(outs) == len(prompts)
    mismatched = []
    for text, out, ref in zip(prompts, outs, refs, strict=True):
        assert out["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text))
        if out["output_ids"] != ref:
            mismatched.append(f"{text[:30]!r}: ours {out['output_ids']} != hf {ref}")
            continue
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason == ("stop" if ref[-1] == eos_id else "length"), f"{text[:30]!r}: finish_reason {reason}"
    assert not mismatched, f"{how}: {len(mismatched)} of {len(prompts)} differ:\n" + "\n".join(mismatched)


def test_logits_match_transformers(default_engine, hf_default_model, hf_default_tokenizer):
    texts = [PLAIN_PROMPTS[0], PLAIN_PROMPTS[8], _LONG,
             hf_default_tokenizer.apply_chat_template(CHAT_CONVERSATIONS[2], tokenize=False)]
    _check_logits(default_engine, hf_default_model, hf_default_tokenizer, texts)


def test_greedy_one_batch_matches_transformers(default_engine, prompts, hf_greedy, hf_default_tokenizer):
    outs = default_engine.generate(prompts, GREEDY)
    _check_outputs(outs, prompts, hf_greedy, hf_default_tokenizer, hf_default_tokenizer.eos_token_id,
                   "one batch")


def test_greedy_one_at_a_time_matches_transformers(default_engine, prompts, hf_greedy, hf_default_tokenizer):
    outs = [default_engine.generate(p, GREEDY) for p in prompts]
    _check_outputs(outs, prompts, hf_greedy, hf_default_tokenizer, hf_default_tokenizer.eos_token_id,
                   "one at a time")


def test_paged_16_logits_and_greedy_match_transformers(paged_engine, prompts, hf_greedy, hf_default_model,
                                                       hf_default_tokenizer, assert_idle):
    _check_logits(paged_engine, hf_default_model, hf_default_tokenizer, [_LONG])
    outs = paged_engine.generate(prompts, GREEDY)
    _check_outputs(outs, prompts, hf_greedy, hf_default_tokenizer, hf_default_tokenizer.eos_token_id,
                   "page_size 16, one batch")
    assert_idle(paged_engine)


def test_mixed_steps_greedy_matches_transformers(prompts, hf_greedy, hf_default_tokenizer, assert_idle):
    """--enable-mixed-chunk: with 32-token prefill chunks the prompts enter a few at a time,
    so most steps decode the running requests beside a prefill chunk; tokens stay exact."""
    import radixserve

    engine = radixserve.Engine(max_total_tokens=16384, enable_mixed_chunk=True, chunked_prefill_size=32)
    try:
        outs = engine.generate(prompts, GREEDY)
        _check_outputs(outs, prompts, hf_greedy, hf_default_tokenizer, hf_default_tokenizer.eos_token_id,
                       "mixed steps, one batch")
        assert engine.scheduler.stats.num_mixed_steps > 10
        assert_idle(engine)
    finally:
        engine.shutdown()
