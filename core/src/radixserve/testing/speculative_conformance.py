"""Conformance suite for speculative methods: any proposer, ours or a third party's.

Each check builds engines on a checkpoint the caller gives (a tiny random model is enough
for most; see ``tests/tiny_models.py``) and raises AssertionError with what went wrong::

    from radixserve.testing import speculative_conformance as sc

    def test_my_method(tiny_model_dir):
        sc.run_all("my_method", tiny_model_dir, prompts=sc.REPEATING_PROMPTS_TINY)

* :func:`check_greedy_parity`: greedy tokens with speculation equal those without, in one
  batch and one at a time, with chunked prefill and the radix cache;
* :func:`check_distribution`: at temperature > 0 (and with top-p/top-k/min-p and
  penalties) the tokens at the first positions follow the same distribution as plain
  sampling (two-sample chi-square over ``num_samples`` requests per engine);
* :func:`check_no_leaks`: aborts mid-speculation and retraction under a small KV pool
  leave every page and request slot accounted for;
* every engine runs with a :class:`StrictProposer` around the method's proposer, which
  fails the check when the proposer breaks the contract (a draft per request, at most
  ``max_tokens`` tokens, valid parents and token ids).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import torch

from radixserve.speculative import Draft, Proposer
from radixserve.speculative.tree import DraftError, validate

# The engine decodes without speculation above this batch size only if asked; the checks
# always speculate.
ALWAYS = 1 << 20


class ContractError(AssertionError):
    """A proposer broke the speculative contract."""


class StrictProposer(Proposer):
    """Wraps a proposer and checks every call against the contract."""

    def __init__(self, inner: Proposer, vocab_size: int) -> None:
        self.inner = inner
        self.vocab_size = vocab_size
        self.hidden_layers = tuple(inner.hidden_layers)
        self.num_proposed = 0
        self.num_drafted = 0
        self.live: set[str] = set()

    def propose(self, reqs, max_tokens):
        out = self.inner.propose(reqs, max_tokens)
        if not isinstance(out, list) or len(out) != len(reqs):
            raise ContractError(f"propose() must return a list with one draft per request ({len(reqs)}), "
                                f"got {type(out).__name__} of {len(out) if hasattr(out, '__len__') else '?'}")
        for req, k, d in zip(reqs, max_tokens, out):
            self.num_proposed += 1
            self.live.add(req.rid)
            if d is None:
                continue
            if not isinstance(d, Draft):
                raise ContractError(f"propose() returned {type(d).__name__}, not a Draft or None")
            if len(d.tokens) > k:
                raise ContractError(f"request {req.rid}: a draft of {len(d.tokens)} tokens over max_tokens {k}")
            try:
                validate(d, self.vocab_size, k)
            except DraftError as e:
                raise ContractError(f"request {req.rid}: {e}") from e
            if d.tokens:
                self.num_drafted += 1
        return out

    def observe(self, steps):
        for st in steps:
            if not 0 <= st.start and st.start + st.num <= st.req.seq_len - 1:
                raise ContractError(f"observe(): positions [{st.start}, {st.start + st.num}) past the request")
            if self.hidden_layers and (st.hidden is None or st.hidden.shape[0] != st.num):
                raise ContractError("observe(): hidden states missing or of the wrong length")
        self.inner.observe(steps)

    def release(self, req):
        self.live.discard(req.rid)
        self.inner.release(req)

    def stats(self):
        return self.inner.stats()


def _engine(model: str, algorithm: str | None, **kwargs):
    from radixserve.engine.engine import Engine

    if algorithm is not None:
        kwargs.setdefault("speculative_disable_by_batch_size", ALWAYS)
    engine = Engine(model, speculative_algorithm=algorithm, enable_leak_check=True, **kwargs)
    if algorithm is not None:
        spec = engine.scheduler.spec
        spec.proposer = StrictProposer(spec.proposer, engine.model_config.vocab_size)
    return engine


def _strict(engine) -> StrictProposer:
    return engine.scheduler.spec.proposer


def check_greedy_parity(algorithm: str, model: str, prompts: Sequence[str | list[int]], *,
                        max_new_tokens: int = 32, min_drafted: int = 1,
                        constrained: tuple[str | list[int], dict] | None = None, **engine_kwargs) -> dict:
    """Greedy outputs with ``algorithm`` equal plain decoding's: one batch, one at a time,
    with chunked prefill (chunks of 8 tokens) and with the radix cache warm. ``constrained``
    (a prompt and sampling params with a grammar, e.g. a ``json_schema``) joins the batched
    runs. Returns the speculative engine's stats of the batched run."""
    sp = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    key = "input_ids" if prompts and not isinstance(prompts[0], str) else "prompt"
    batch = list(prompts) + ([constrained[0]] if constrained else [])
    params = [sp] * len(prompts) + ([{"temperature": 0.0, **constrained[1]}] if constrained else [])
    plain = _engine(model, None, **engine_kwargs)
    try:
        ref_all = [o["output_ids"] for o in plain.generate(**{key: batch}, sampling_params=params)]
    finally:
        plain.shutdown()
    ref = ref_all[:len(prompts)]
    runs = {"one batch": {}, "chunked prefill": {"chunked_prefill_size": 8}}
    stats = {}
    for how, extra in runs.items():
        engine = _engine(model, algorithm, **{**engine_kwargs, **extra})
        try:
            batched = [o["output_ids"] for o in engine.generate(**{key: batch}, sampling_params=params)]
            _same(ref_all, batched, f"{algorithm}, {how}" + (" with a constrained request" if constrained else ""))
            if how == "one batch":
                stats = engine.get_stats()
                if _strict(engine).num_drafted < min_drafted:
                    raise AssertionError(f"{algorithm}: only {_strict(engine).num_drafted} drafts were proposed; "
                                         f"the parity check needs prompts the method drafts for")
                # again one at a time, with every prompt's prefix now cached
                single = [engine.generate(**{key: p}, sampling_params=sp)["output_ids"] for p in prompts]
                _same(ref, single, f"{algorithm}, one at a time, radix cache warm")
        finally:
            engine.shutdown()
    return stats


def _same(ref: list[list[int]], got: list[list[int]], how: str) -> None:
    bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]
    if bad:
        i = bad[0]
        raise AssertionError(f"{how}: {len(bad)} of {len(ref)} outputs differ from plain decoding; "
                             f"prompt {i}: plain {ref[i]} != speculative {got[i]}")


def chi2_two_sample(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of a two-sample chi-square test of equal
    distributions; categories with too few counts are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cells, pooled = [], [0, 0]
    for k in keys:
        tot = a[k] + b[k]
        if min(na, nb) * tot / (na + nb) >= min_expected:
            cells.append((a[k], b[k]))
        else:
            pooled[0] += a[k]
            pooled[1] += b[k]
    if sum(pooled):
        cells.append(tuple(pooled))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        ea, eb = na * tot / (na + nb), nb * tot / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    df = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def sample_positions(engine, prompt, params: dict, num_samples: int, positions: int, batch: int = 256,
                     seed0: int = 0) -> list[Counter]:
    """Token counts at each of the first ``positions`` output positions over ``num_samples``
    seeded requests."""
    key = "input_ids" if not isinstance(prompt, str) else "prompt"
    counts = [Counter() for _ in range(positions)]
    done = 0
    while done < num_samples:
        n = min(batch, num_samples - done)
        sps = [{**params, "max_new_tokens": positions, "ignore_eos": True, "seed": seed0 + done + i}
               for i in range(n)]
        outs = engine.generate(**{key: [prompt] * n}, sampling_params=sps)
        for o in outs:
            reason = o["meta_info"]["finish_reason"]
            if reason["type"] == "abort" or len(o["output_ids"]) != positions:
                raise AssertionError(f"a sampled request ended with {reason} after {len(o['output_ids'])} tokens")
            for pos, tok in enumerate(o["output_ids"]):
                counts[pos][tok] += 1
        done += n
    return counts


DISTRIBUTION_PARAMS = (
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40},
    {"temperature": 1.2, "min_p": 0.05, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
)


def check_distribution(algorithm: str, model: str, prompt: str | list[int], *, num_samples: int = 2000,
                       positions: int = 3, params_list: Sequence[dict] = DISTRIBUTION_PARAMS,
                       alpha: float = 1e-3, min_drafted: int = 1, **engine_kwargs) -> list[float]:
    """Per sampling setting and output position, a two-sample chi-square test between
    plain and speculative sampling; fails when any p-value is below ``alpha`` (Bonferroni
    corrected over the tests). Returns the p-values."""
    plain = _engine(model, None, **engine_kwargs)
    spec = _engine(model, algorithm, **engine_kwargs)
    pvalues, failures = [], []
    n_tests = len(params_list) * positions
    try:
        for params in params_list:
            a = sample_positions(plain, prompt, params, num_samples, positions, seed0=0)
            b = sample_positions(spec, prompt, params, num_samples, positions, seed0=10**6)
            for pos in range(positions):
                stat, df, p = chi2_two_sample(a[pos], b[pos])
                pvalues.append(p)
                if p < alpha / n_tests:
                    failures.append(f"{params} position {pos}: chi2 {stat:.1f} on {df} df, p = {p:.2e}")
        drafted = _strict(spec).num_drafted
    finally:
        plain.shutdown()
        spec.shutdown()
    if drafted < min_drafted:
        raise AssertionError(f"{algorithm}: only {drafted} drafts were proposed; the test proves nothing")
    if failures:
        raise AssertionError(f"{algorithm}: speculative sampling differs from plain sampling:\n" + "\n".join(failures))
    return pvalues


def check_no_leaks(algorithm: str, model: str, prompts: Sequence[str | list[int]], **engine_kwargs) -> None:
    """Aborts in the middle of speculative decoding, and retraction under a KV pool too
    small for every request, keep the idle invariant (checked by the engine itself with
    ``enable_leak_check``)."""
    import asyncio

    key = "input_ids" if not isinstance(prompts[0], str) else "prompt"
    longest = max(len(p) for p in prompts) if key == "input_ids" else 64
    tight = {**engine_kwargs, "max_total_tokens": max(128, 2 * longest + 96), "page_size": 4}
    engine = _engine(model, algorithm, **tight)
    try:
        sp = {"temperature": 0.7, "max_new_tokens": 48, "ignore_eos": True}
        engine.generate(**{key: list(prompts) * 3}, sampling_params=sp)  # retraction under pressure

        async def abort_midway():
            async def one(p, stop_after):
                stream = await engine.async_generate(**{key: p}, sampling_params=sp, stream=True)
                n = 0
                async for _ in stream:
                    n += 1
                    if n >= stop_after:
                        break
                await stream.aclose()  # aborts the request mid-speculation
            await asyncio.gather(*(one(p, 1 + i % 3) for i, p in enumerate(prompts)))

        asyncio.run(abort_midway())
        deadline = time.monotonic() + 30
        while engine.scheduler.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.check_idle_invariant()
    finally:
        engine.shutdown()


def run_all(algorithm: str, model: str, *, prompts: Sequence[str | list[int]], distribution_prompt=None,
            num_samples: int = 2000, **engine_kwargs) -> None:
    """Every check above, on ``model``."""
    check_greedy_parity(algorithm, model, prompts, **engine_kwargs)
    check_distribution(algorithm, model, distribution_prompt if distribution_prompt is not None else prompts[0],
                       num_samples=num_samples, **engine_kwargs)
    check_no_leaks(algorithm, model, prompts, **engine_kwargs)


__all__ = ["ContractError", "StrictProposer", "check_distribution", "check_greedy_parity", "check_no_leaks",
           "chi2_two_sample", "run_all", "sample_positions"]
