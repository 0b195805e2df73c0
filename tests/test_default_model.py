"""The default GGUF checkpoint (SmolLM2-135M-Instruct, Q4_1) against transformers.

transformers dequantises the same GGUF file to float32; so does our loader, and the
engine runs in float32 on CPU. So logits must agree to float32 rounding and greedy
decoding must produce exactly the same tokens, EOS included (both stop there).

transformers is the oracle for greedy tokens by teacher forcing: one forward pass of its
model over prompt + our output (no padding, one prompt at a time) gives its argmax at every
position, which must be our next token at each step, and EOS where we stopped early. That is
transformers' greedy decoding checked token by token, at the cost of one forward per prompt
instead of one per generated token. The engine is checked this way run four ways: all
prompts in one ``generate`` call, one prompt per call, all prompts in one call with 16-token
pages, and with mixed prefill+decode steps.
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
def prompts(default_prompts) -> list[str]:
    """PLAIN_PROMPTS, then CHAT_CONVERSATIONS through the chat template (conftest.py)."""
    assert len(default_prompts) >= 20
    return default_prompts


class GreedyOracle:
    """transformers' greedy choices along a continuation, by teacher forcing.

    Checked continuations are remembered, so the engine's four runs (which agree with each
    other) cost one forward pass per prompt in all."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.eos_id = tokenizer.eos_token_id
        self._seen: dict[tuple, str | None] = {}

    def check(self, prompt_ids: list[int], output_ids: list[int]) -> str | None:
        """None when every output token is transformers' argmax after the tokens before it,
        and the output ends with EOS exactly when it is shorter than NEW_TOKENS; otherwise what
        differs. A token whose transformers logit is within the logits tolerance of the
        maximum counts as the argmax (a float32 near-tie, which summation order decides)."""
        key = (tuple(prompt_ids), tuple(output_ids))
        if key not in self._seen:
            self._seen[key] = self._check(prompt_ids, output_ids)
        return self._seen[key]

    def _check(self, prompt_ids, output_ids) -> str | None:
        if not output_ids:
            return "no output"
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
        best = logits.max(dim=-1).values  # [len(output)]
        tol = LOGITS_RTOL * max(1.0, logits.abs().max().item())
        for i, tok in enumerate(output_ids):
            if logits[i, tok] < best[i] - tol:
                return (f"token {i}: ours {tok}, transformers {int(logits[i].argmax())} "
                        f"(logit {logits[i, tok]:.4f} vs {best[i]:.4f}); ours {output_ids}")
        stopped = output_ids[-1] == self.eos_id
        if stopped != (len(output_ids) < NEW_TOKENS):
            return f"{len(output_ids)} tokens, ending {'with' if stopped else 'without'} EOS: {output_ids}"
        return None


@pytest.fixture(scope="module")
def hf_oracle(hf_default_model, hf_default_tokenizer) -> GreedyOracle:
    return GreedyOracle(hf_default_model, hf_default_tokenizer)


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


def _check_outputs(outs, prompts, oracle: GreedyOracle, how: str) -> None:
    assert len(outs) == len(prompts)
    mismatched = []
    for text, out in zip(prompts, outs, strict=True):
        prompt_ids = oracle.tokenizer.encode(text)
        assert out["meta_info"]["prompt_tokens"] == len(prompt_ids)
        problem = oracle.check(prompt_ids, out["output_ids"])
        if problem is not None:
            mismatched.append(f"{text[:30]!r}: {problem}")
            continue
        reason = out["meta_info"]["finish_reason"]["type"]
        stopped = out["output_ids"][-1] == oracle.eos_id
        assert reason == ("stop" if stopped else "length"), f"{text[:30]!r}: finish_reason {reason}"
    assert not mismatched, f"{how}: {len(mismatched)} of {len(prompts)} differ:\n" + "\n".join(mismatched)


def test_logits_match_transformers(default_engine, hf_default_model, hf_default_tokenizer):
    texts = [PLAIN_PROMPTS[0], PLAIN_PROMPTS[8], _LONG,
             hf_default_tokenizer.apply_chat_template(CHAT_CONVERSATIONS[2], tokenize=False)]
    _check_logits(default_engine, hf_default_model, hf_default_tokenizer, texts)


def test_greedy_one_batch_matches_transformers(default_greedy_outputs, prompts, hf_oracle):
    """The default engine's one ``generate`` call over every prompt (conftest.py: computed once
    per session, the plain-decoding reference of other modules)."""
    _check_outputs(default_greedy_outputs, prompts, hf_oracle, "one batch")


def test_greedy_one_at_a_time_matches_transformers(default_engine, prompts, hf_oracle):
    outs = [default_engine.generate(p, GREEDY) for p in prompts]
    _check_outputs(outs, prompts, hf_oracle, "one at a time")


def test_paged_16_logits_and_greedy_match_transformers(paged_engine, prompts, hf_oracle, hf_default_model,
                                                       hf_default_tokenizer, assert_idle):
    _check_logits(paged_engine, hf_default_model, hf_default_tokenizer, [_LONG])
    outs = paged_engine.generate(prompts, GREEDY)
    _check_outputs(outs, prompts, hf_oracle, "page_size 16, one batch")
    assert_idle(paged_engine)


def test_mixed_steps_greedy_matches_transformers(prompts, hf_oracle, assert_idle):
    """--enable-mixed-chunk: with 32-token prefill chunks the prompts enter a few at a time,
    so most steps decode the running requests beside a prefill chunk; tokens stay exact."""
    import radixserve

    engine = radixserve.Engine(max_total_tokens=16384, enable_mixed_chunk=True, chunked_prefill_size=32)
    try:
        outs = engine.generate(prompts, GREEDY)
        _check_outputs(outs, prompts, hf_oracle, "mixed steps, one batch")
        assert engine.scheduler.stats.num_mixed_steps > 10
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_default_stall_free_steps_greedy_match_transformers(prompts, hf_oracle, assert_idle):
    """Default flags (mixed steps, the measured budget; a 1 ms target so every mixed step
    takes the 64-token floor): the first prompt decodes while the others arrive, so they
    prefill in budgeted chunks beside decoding rows; tokens stay those of transformers (the
    old path, separate prefill steps, is checked against the same oracle above)."""
    import radixserve
    from radixserve.engine.request import Req
    from radixserve.engine.scheduler.budget import MIN_PREFILL_TOKENS
    from radixserve.sampling import SamplingParams

    engine = radixserve.Engine(max_total_tokens=16384, mixed_chunk_target_itl_ms=1.0)
    try:
        sched = engine.scheduler
        assert sched.planner.step_budget is sched.budget
        ids = [hf_oracle.tokenizer.encode(text) for text in prompts]
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
        reqs = [Req(f"r{i}", p, params, NEW_TOKENS) for i, p in enumerate(ids)]
        sched.add_request(reqs[0])
        while len(reqs[0].output_ids) < 2:
            sched.step()
        for r in reqs[1:]:
            sched.add_request(r)
        while sched.has_work:
            sched.step()
        mismatched = [f"{text[:30]!r}: {problem}" for text, p, r in zip(prompts, ids, reqs)
                      if (problem := hf_oracle.check(p, r.output_ids)) is not None]
        assert not mismatched, "\n".join(mismatched)
        assert sched.stats.num_mixed_steps > 5 and sched.get_stats()["step_budget_tokens"] == MIN_PREFILL_TOKENS
        assert_idle(engine)
    finally:
        engine.shutdown()
