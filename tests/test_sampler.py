"""Tests for radixserve.sampling: parameter validation and the batched sampler.

References are computed independently in plain Python (``math``), never by the code
under test. Vocabulary size is 50 throughout.
"""

from __future__ import annotations

import math

import pytest
import torch
from radixserve.sampling import (
    InvalidSamplingParams,
    PenaltyState,
    SampleOutput,
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
)
from radixserve.sampling.sampler import make_generator

V = 50
EOS = 0


# ----------------------------------------------------------------------------- helpers


def build(
    params: list[SamplingParams],
    histories=None,
    num_out=None,
    eos=(EOS,),
    generators=None,
    shared=None,
) -> SamplingBatchInfo:
    for p in params:
        p.verify(V)
    b = len(params)
    if generators is None:
        generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    return SamplingBatchInfo.build(
        params,
        generators,
        histories if histories is not None else [([], [])] * b,
        num_out if num_out is not None else [0] * b,
        set(eos),
        V,
        "cpu",
        shared_generator=shared,
    )


def sample(logits: torch.Tensor, params, **kw) -> SampleOutput:
    return Sampler().sample(logits, build(params, **kw))


def ref_softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    m = max(row)
    exps = [math.exp((x - m) / temperature) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def ref_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    log_total = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - log_total for x in row]


def ref_allowed(row, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> set[int]:
    """Tokens that survive top-k, then top-p (renormalised), then min-p, in plain Python."""
    probs = ref_softmax(row, temperature)
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    if top_k >= 1:
        order = order[:top_k]
    if top_p < 1.0:
        total = sum(probs[i] for i in order)
        kept, mass = [], 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i] / total
        order = kept
    if min_p > 0.0:
        best = probs[order[0]]
        order = [i for i in order if probs[i] >= min_p * best]
    return set(order)


def designed_logits() -> list[float]:
    """Known probabilities at scattered positions, the rest spread thin."""
    probs = [0.07 / 44] * V
    for pos, p in zip([17, 3, 42, 8, 29, 11], [0.30, 0.22, 0.16, 0.12, 0.08, 0.05], strict=True):
        probs[pos] = p
    return [math.log(p) for p in probs]


def peaked(values: dict[int, float], base: float = -5.0) -> torch.Tensor:
    row = torch.full((V,), base)
    for i, x in values.items():
        row[i] = x
    return row.view(1, V)  # [1, V]


def draw_many(row: list[float], params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = torch.tensor([row] * n)  # [n, V]
    gen = make_generator(1234)
    return sample(
        logits, [SamplingParams(**vars(params)) for _ in range(n)], shared=gen
    ).next_token_ids


# ----------------------------------------------------------------------------- greedy


def test_greedy_rows_take_argmax():
    logits = torch.randn(6, V, generator=make_generator(0))  # [6, V]
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1, temperature=0.8)] * 3
    params = [SamplingParams(**vars(p)) for p in params]
    out = sample(logits, params)
    expected = [max(range(V), key=lambda i: row[i]) for row in logits.tolist()]
    assert out.next_token_ids.tolist() == expected
    assert out.next_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = torch.randn(8, V, generator=make_generator(1))  # [8, V]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(8)]
    out = sample(logits, params, shared=make_generator(5))
    for i in range(0, 8, 2):
        assert out.next_token_ids[i].item() == max(range(V), key=lambda j: logits[i, j].item())


def test_all_greedy_batch_builds_no_sampling_or_penalty_tensors():
    info = build([SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
    assert info.is_all_greedy
    assert info.temperatures is None and info.top_ks is None and info.top_ps is None
    assert info.repetition_mask is None and info.output_counts is None
    assert info.banned_rows is None and not info.has_penalties


def test_logits_are_not_modified():
    logits = torch.randn(2, V, generator=make_generator(2))  # [2, V]
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, min_new_tokens=2, top_k=3),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ]
    sample(logits, params, histories=[([1, 2], [3]), ([4], [4, 5])])
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_temperature_sampling_matches_softmax(temperature):
    row = (torch.randn(V, generator=make_generator(3)) * 1.5).tolist()
    n = 20000
    ids = draw_many(row, SamplingParams(temperature=temperature), n)
    counts = torch.bincount(ids, minlength=V).tolist()
    for p, c in zip(ref_softmax(row, temperature), counts, strict=True):
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(c / n - p) <= 5 * sigma + 1e-4


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 4},
        {"top_k": 2, "temperature": 3.0},
        {"top_p": 0.75},
        {"top_p": 0.5, "temperature": 2.0},
        {"min_p": 0.3},
        {"min_p": 0.2, "temperature": 0.5},
        # top-p over the top-k survivors renormalised: keeps 2 tokens, not 3
        {"top_k": 3, "top_p": 0.7},
        {"top_k": 5, "top_p": 0.9, "min_p": 0.3},
    ],
)
def test_filters_emit_exactly_the_allowed_tokens(filters):
    row = designed_logits()
    allowed = ref_allowed(row, **filters)
    assert 1 <= len(allowed) < V
    ids = draw_many(row, SamplingParams(**filters), 4000)
    assert set(ids.tolist()) == allowed


def test_top_k_top_p_order_is_sequential():
    """Guards the documented choice: top-p sees the distribution left by top-k."""
    row = designed_logits()
    ids = draw_many(row, SamplingParams(top_k=3, top_p=0.7), 4000)
    assert set(ids.tolist()) == {17, 3}


def test_filtered_rows_sampled_in_proportion():
    row = designed_logits()
    n = 20000
    ids = draw_many(row, SamplingParams(top_k=3), n)
    probs = ref_softmax(row)
    kept = sum(probs[i] for i in (17, 3, 42))
    counts = torch.bincount(ids, minlength=V)
    for i in (17, 3, 42):
        p = probs[i] / kept
        assert abs(counts[i].item() / n - p) <= 5 * math.sqrt(p * (1 - p) / n)


# ----------------------------------------------------------------------------- penalties


def greedy_pick(logits, params, history=([], []), num_out=0, eos=(EOS,)) -> int:
    params.temperature = 0.0
    out = sample(logits, [params], histories=[history], num_out=[num_out], eos=eos)
    return out.next_token_ids.item()


@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_divides_positive_logits(where):
    logits = peaked({3: 2.0, 7: 1.5})
    history = ([3], []) if where == "prompt" else ([], [3])
    # 2.0 / 1.5 = 1.33 < 1.5; 2.0 / 1.2 = 1.67 > 1.5
    assert greedy_pick(logits, SamplingParams(repetition_penalty=1.5), history) == 7
    assert greedy_pick(logits, SamplingParams(repetition_penalty=1.2), history) == 3
    assert greedy_pick(logits, SamplingParams(repetition_penalty=1.5), ([7], [])) == 3


def test_repetition_penalty_multiplies_negative_logits():
    logits = peaked({3: -1.0, 7: -1.2})
    # -1.0 * 1.3 = -1.3 < -1.2; -1.0 * 1.1 = -1.1 > -1.2
    assert greedy_pick(logits, SamplingParams(repetition_penalty=1.3), ([3], [])) == 7
    assert greedy_pick(logits, SamplingParams(repetition_penalty=1.1), ([3], [])) == 3
    # a penalty below 1 rewards: -1.2 * 0.8 = -0.96 > -1.0
    assert greedy_pick(logits, SamplingParams(repetition_penalty=0.8), ([7], [])) == 7


def test_frequency_penalty_scales_with_output_count():
    logits = peaked({3: 2.0, 7: 1.2})
    # two occurrences: 2.0 - 2 * 0.5 = 1.0 < 1.2; 2.0 - 2 * 0.3 = 1.4 > 1.2
    assert greedy_pick(logits, SamplingParams(frequency_penalty=0.5), ([], [3, 3])) == 7
    assert greedy_pick(logits, SamplingParams(frequency_penalty=0.3), ([], [3, 3])) == 3
    # one occurrence: 2.0 - 0.5 = 1.5 > 1.2
    assert greedy_pick(logits, SamplingParams(frequency_penalty=0.5), ([], [3])) == 3
    # prompt tokens are not counted
    assert greedy_pick(logits, SamplingParams(frequency_penalty=2.0), ([3, 3, 3], [])) == 3
    # a negative penalty rewards: 1.2 + 2 * 0.5 = 2.2 > 2.0
    assert greedy_pick(logits, SamplingParams(frequency_penalty=-0.5), ([], [7, 7])) == 7


def test_presence_penalty_is_flat_in_count():
    logits = peaked({3: 2.0, 7: 1.5})
    out = [3] * 5
    # 2.0 - 0.6 = 1.4 < 1.5; 2.0 - 0.4 = 1.6 > 1.5 (it would be 0.0 if scaled by count)
    assert greedy_pick(logits, SamplingParams(presence_penalty=0.6), ([], out)) == 7
    assert greedy_pick(logits, SamplingParams(presence_penalty=0.4), ([], out)) == 3
    assert greedy_pick(logits, SamplingParams(presence_penalty=2.0), ([3], [])) == 3


def ref_penalised(row, params: SamplingParams, prompt, output) -> list[float]:
    row = list(row)
    for t in set(prompt) | set(output):
        p = params.repetition_penalty
        row[t] = row[t] / p if row[t] > 0 else row[t] * p
    for t in set(output):
        row[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return row


def test_all_penalties_together_match_the_formula_on_every_token():
    gen = make_generator(4)
    logits = torch.randn(3, V, generator=gen) * 2  # [3, V]
    histories = [
        (
            torch.randint(0, V, (30,), generator=gen).tolist(),
            torch.randint(0, V, (12,), generator=gen).tolist(),
        )
        for _ in range(3)
    ]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
        SamplingParams(repetition_penalty=0.9, frequency_penalty=-0.5, presence_penalty=1.5),
        SamplingParams(),  # unpenalised row in a penalised batch
    ]
    for p in params:
        p.temperature = 0.0
        p.return_logprob = True
        p.top_logprobs_num = 20
    out = sample(logits, params, histories=histories)
    for i, p in enumerate(params):
        ref = ref_penalised(logits[i].tolist(), p, *histories[i])
        ref_lp = ref_log_softmax(ref)
        assert out.next_token_ids[i].item() == max(range(V), key=lambda t: ref[t])
        ids, values = out.top_logprobs[i]
        assert values == pytest.approx([ref_lp[t] for t in ids], abs=1e-5)
        assert sorted(ref_lp, reverse=True)[:20] == pytest.approx(values, abs=1e-5)


def test_penalty_states_give_the_tensors_a_full_history_gives_step_after_step():
    """Running statistics advanced one token per step (plus unadvanced drafts on top, as a
    speculative step passes them) build the same penalty tensors as the whole history."""
    gen = make_generator(9)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(),
    ]
    for p in params:
        p.verify(V)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (20, 5, 9, 3)]
    states = [PenaltyState(p, prompt, V) for p, prompt in zip(params, prompts)]
    assert states[1].counts is None and states[2].seen is None and states[3].seen is states[3].counts is None
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(12):
        for out in outputs:
            out.extend(torch.randint(0, V, (1 + step % 3,), generator=gen).tolist())
        drafts = [torch.randint(0, V, (step % 4,), generator=gen).tolist() for _ in params]
        for st, out in zip(states, outputs):
            st.advance(out)
        histories = [(pr, out + d) for pr, out, d in zip(prompts, outputs, drafts)]
        full = build(params, histories=histories)
        kept = SamplingBatchInfo.build(params, [None] * 4, histories, [0] * 4, {EOS}, V, "cpu",
                                       penalty_states=states)
        assert torch.equal(full.repetition_mask, kept.repetition_mask)
        assert torch.equal(full.output_counts, kept.output_counts)
    with pytest.raises(ValueError, match="shrank"):
        states[0].advance(outputs[0][:-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        states[0].advance(outputs[0] + [V])


# ----------------------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = peaked({EOS: 5.0, 1: 4.8, 9: 4.0, 11: 3.5, 20: 2.0})
    params = SamplingParams(min_new_tokens=3, stop_token_ids=[9, 11])
    for num_out in range(3):
        assert greedy_pick(logits, params, num_out=num_out, eos=(EOS, 1)) == 20
    assert greedy_pick(logits, params, num_out=3, eos=(EOS, 1)) == EOS
    # ignore_eos gets no special case here: the mask still applies
    params = SamplingParams(min_new_tokens=2, ignore_eos=True)
    assert greedy_pick(logits, params, num_out=0, eos=(EOS,)) == 1


def test_min_new_tokens_is_per_row_and_holds_when_sampling():
    logits = peaked({EOS: 3.0, 9: 3.0, 20: 2.0, 21: 2.0}).repeat(2000, 1)  # [2000, V]
    params = [
        SamplingParams(min_new_tokens=1, stop_token_ids=[9], top_p=0.99)
        if i % 2 == 0
        else SamplingParams()
        for i in range(2000)
    ]
    out = sample(logits, params, shared=make_generator(6))
    blocked = set(out.next_token_ids[0::2].tolist())
    free = set(out.next_token_ids[1::2].tolist())
    assert EOS not in blocked and 9 not in blocked and {20, 21} <= blocked
    assert EOS in free and 9 in free


# ----------------------------------------------------------------------------- seeds


STEPS = 25


def step_logits(step: int, row: int) -> torch.Tensor:
    return torch.randn(V, generator=make_generator(1000 * row + step))  # [V]


def run_rows(params: list[SamplingParams], watch: int, logits_row_of=None) -> list[int]:
    """Decode STEPS steps; the watched row always sees step_logits(step, 0)."""
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    seq = []
    for step in range(STEPS):
        rows = [step_logits(step, 0 if i == watch else i + 1) for i in range(len(params))]
        info = build(params, generators=gens, shared=make_generator(99 + step))
        seq.append(Sampler().sample(torch.stack(rows), info).next_token_ids[watch].item())
    return seq


def test_same_seed_same_tokens_in_any_batch():
    alone = run_rows([SamplingParams(seed=42)], watch=0)
    in_batch = run_rows(
        [
            SamplingParams(seed=7),
            SamplingParams(temperature=0.5),
            SamplingParams(seed=42),
            SamplingParams(temperature=0.0),
        ],
        watch=2,
    )
    filtered_batch = run_rows(
        [
            SamplingParams(seed=42),
            SamplingParams(top_k=5, top_p=0.8, min_p=0.1),
            SamplingParams(seed=42, temperature=0.0, return_logprob=True),
        ],
        watch=0,
    )
    assert alone == in_batch == filtered_batch
    assert len(set(alone)) > 5  # really sampled, not collapsed to one token


def test_different_seeds_differ():
    a = run_rows([SamplingParams(seed=42)], watch=0)
    b = run_rows([SamplingParams(seed=43)], watch=0)
    assert a != b


def test_seeded_row_needs_a_generator():
    with pytest.raises(ValueError, match=r"generators\[1\]"):
        build([SamplingParams(), SamplingParams(seed=3)], generators=[None, None])


def test_build_rejects_mismatched_lengths_and_bad_history():
    with pytest.raises(ValueError, match="token_histories"):
        build([SamplingParams()], histories=[([], []), ([], [])])
    with pytest.raises(ValueError, match="num_output_tokens"):
        build([SamplingParams()], num_out=[0, 0])
    with pytest.raises(ValueError, match="vocabulary"):
        build([SamplingParams(repetition_penalty=1.2)], histories=[([V + 3], [])])


def test_sample_rejects_wrong_logits_shape():
    info = build([SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, V), info)


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_before_temperature():
    logits = torch.randn(4, V, generator=make_generator(8)) * 3  # [4, V]
    params = [
        SamplingParams(temperature=0.5, return_logprob=True, top_logprobs_num=5),
        SamplingParams(temperature=1.3, top_k=4, return_logprob=True),
        SamplingParams(return_logprob=False, top_logprobs_num=3),  # not asked: ignored
        SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=20),
    ]
    out = sample(logits, params, shared=make_generator(9))
    assert out.logprobs.shape == (4,)
    for i in (0, 1, 3):
        ref = ref_log_softmax(logits[i].tolist())
        assert out.logprobs[i].item() == pytest.approx(ref[out.next_token_ids[i].item()], abs=1e-5)
    sizes = [len(out.top_logprobs[i][0]) for i in range(4)]
    assert sizes == [5, 0, 0, 20]
    assert out.top_logprobs[1] == ([], []) and out.top_logprobs[2] == ([], [])
    for i in (0, 3):
        ids, values = out.top_logprobs[i]
        ref = ref_log_softmax(logits[i].tolist())
        assert values == sorted(values, reverse=True)
        assert len(set(ids)) == len(ids)
        assert values == pytest.approx([ref[t] for t in ids], abs=1e-5)
        assert values == pytest.approx(sorted(ref, reverse=True)[: len(ids)], abs=1e-5)
    assert out.top_logprobs[3][0][0] == out.next_token_ids[3].item()


def test_no_logprobs_unless_asked():
    out = sample(torch.randn(2, V), [SamplingParams(top_logprobs_num=4), SamplingParams()])
    assert out.logprobs is None and out.top_logprobs is None


# ----------------------------------------------------------------------------- logit_bias


def test_logit_bias_is_normalised_to_int_keys():
    p = SamplingParams(logit_bias={"7": 5, 3: -2.5, " 9": 100})
    p.verify(V)
    assert p.logit_bias == {7: 5.0, 3: -2.5, 9: 100.0}
    assert all(type(v) is float for v in p.logit_bias.values())
    p.verify(V)  # idempotent
    assert p.logit_bias == {7: 5.0, 3: -2.5, 9: 100.0}
    empty = SamplingParams(logit_bias={})
    empty.verify(V)
    assert empty.logit_bias is None


def test_logit_bias_is_added_before_logprobs_and_greedy():
    logits = torch.randn(3, V, generator=make_generator(11))  # [3, V]
    bias = {4: 2.5, 9: -1.0, 30: 0.75}
    params = [SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=5,
                             logit_bias={str(k): v for k, v in bias.items()}),
              SamplingParams(temperature=0.0, return_logprob=True),  # no bias: untouched
              SamplingParams(temperature=0.0, return_logprob=True, logit_bias={"4": 50})]
    original = logits.clone()
    out = sample(logits, params)
    assert torch.equal(logits, original)  # the caller's tensor is not modified
    row0 = logits[0].tolist()
    for k, v in bias.items():
        row0[k] += v
    ref0 = ref_log_softmax(row0)
    assert out.next_token_ids[0].item() == max(range(V), key=lambda i: row0[i])
    ids, values = out.top_logprobs[0]
    assert values == pytest.approx([ref0[t] for t in ids], abs=1e-5)
    assert values == pytest.approx(sorted(ref0, reverse=True)[:5], abs=1e-5)
    ref1 = ref_log_softmax(logits[1].tolist())
    assert out.next_token_ids[1].item() == max(range(V), key=lambda i: ref1[i])
    assert out.logprobs[1].item() == pytest.approx(max(ref1), abs=1e-5)
    assert out.next_token_ids[2].item() == 4


def test_logit_bias_plus_100_forces_and_minus_100_forbids_in_a_mixed_batch():
    logits = torch.randn(64, V, generator=make_generator(12)) * 4  # [64, V]
    favourite = logits.argmax(dim=-1)  # [64] each row's own top token
    params = []
    for i in range(64):
        greedy = i % 2 == 0
        base = {"temperature": 0.0} if greedy else {"temperature": 1.5, "top_p": 0.9}
        if i % 4 < 2:
            params.append(SamplingParams(**base, logit_bias={"13": 100}))  # forced
        else:
            params.append(SamplingParams(**base, logit_bias={str(int(favourite[i])): -100}))  # banned
    out = sample(logits, params, shared=make_generator(13))
    ids = out.next_token_ids.tolist()
    for i in range(64):
        if i % 4 < 2:
            assert ids[i] == 13, f"row {i}: +100 must force token 13"
        else:
            assert ids[i] != int(favourite[i]), f"row {i}: -100 must forbid its top token"
    # greedy banned rows take the second best
    for i in range(2, 64, 4):
        assert ids[i] == logits[i].topk(2).indices[1].item()


def test_logit_bias_applies_before_penalties_and_min_tokens():
    logits = peaked({5: 3.0, EOS: 4.0}, base=0.0)  # [1, V]
    # the bias lifts token 6 above 5, then the repetition penalty (token 6 seen) halves it
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={6: 5.0})
    out = sample(logits, [p], histories=[([6], [])], num_out=[0])
    assert out.next_token_ids.tolist() == [EOS]  # (0 + 5) / 2 = 2.5 < 3 < 4
    # min_new_tokens still bans EOS even with a +100 bias on it
    p = SamplingParams(temperature=0.0, min_new_tokens=2, logit_bias={EOS: 100})
    out = sample(logits, [p], num_out=[0])
    assert out.next_token_ids.tolist() == [5]


def test_logit_bias_in_sampled_rows_shifts_the_distribution():
    row = designed_logits()
    p = SamplingParams(temperature=1.0, seed=None, logit_bias={"40": math.log(0.30 / (0.07 / 44))})
    p.verify(V)
    ids = draw_many(row, p, n=4000)
    # token 40 now has the same logit as token 17 (p = 0.30 before): together ~0.46 of draws
    share = (ids == 40).float().mean().item()
    biased = list(row)
    biased[40] += p.logit_bias[40]
    assert share == pytest.approx(ref_softmax(biased)[40], abs=0.03)


# ----------------------------------------------------------------------------- params


INVALID = [
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", "10"),
    ("max_new_tokens", True),
    ("min_new_tokens", -1),
    ("min_new_tokens", None),
    ("min_new_tokens", 2.0),
    ("min_new_tokens", True),
    ("temperature", -0.1),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", "0.9"),
    ("top_p", False),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", "0"),
    ("min_p", True),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", "1"),
    ("repetition_penalty", True),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", "0"),
    ("frequency_penalty", True),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3),
    ("presence_penalty", "x"),
    ("presence_penalty", False),
    ("seed", -1),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("seed", 2**64),
    ("stop", 5),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["a", 3]),
    ("stop", {"a"}),
    ("stop_token_ids", 5),
    ("stop_token_ids", ["1"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, V]),
    ("ignore_eos", 1),
    ("ignore_eos", "true"),
    ("ignore_eos", None),
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("return_logprob", 1),
    ("return_logprob", "yes"),
    ("top_logprobs_num", -1),
    ("top_logprobs_num", 21),
    ("top_logprobs_num", True),
    ("top_logprobs_num", 2.0),
    ("skip_special_tokens", "no"),
    ("skip_special_tokens", 0),
    ("spaces_between_special_tokens", None),
    ("no_stop_trim", 1),
    ("json_schema", {"type": "object"}),
    ("regex", 5),
    ("ebnf", ["root ::= x"]),
    ("stop_regex", "a*"),
    ("stop_regex", ["("]),
    ("return_hidden_states", "all"),
    ("sampling_seed", -1),
    ("custom_params", [1]),
    ("stream_interval", 0),
    ("beam_width", 2),
    ("structural_tag", "{}"),
    ("watermark", {"key": 1}),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {"1.5": 1}),
    ("logit_bias", {True: 1}),
    ("logit_bias", {str(V): 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"3": 100.5}),
    ("logit_bias", {"3": -101}),
    ("logit_bias", {"3": "5"}),
    ("logit_bias", {"3": True}),
    ("logit_bias", {"3": float("nan")}),
    ("logit_bias", {"3": 1, 3: 2}),
    ("logprob_start_len", -2),
    ("logprob_start_len", 1.0),
    ("logprob_start_len", None),
    ("logprob_start_len", True),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_is_named(field, value):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value}).verify(vocab_size=V)
    assert err.value.param == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_dict({field: value}, vocab_size=V)
    assert err.value.param == field


def test_every_field_has_an_invalid_case():
    assert {f for f, _ in INVALID} == set(SamplingParams.field_names())


def test_min_new_tokens_above_max_new_tokens():
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(min_new_tokens=5, max_new_tokens=3).verify()
    assert err.value.param == "min_new_tokens"
    assert "max_new_tokens" in str(err.value)
    SamplingParams(min_new_tokens=5, max_new_tokens=None).verify()
    SamplingParams(min_new_tokens=3, max_new_tokens=3).verify()


def test_error_message_names_field_and_value():
    with pytest.raises(InvalidSamplingParams, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5).verify()


def test_valid_edges_and_normalisation():
    p = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=1,
        frequency_penalty=-2,
        presence_penalty=2,
        seed=0,
        stop="###",
        stop_token_ids=(V - 1,),
        max_new_tokens=0,
        top_logprobs_num=20,
    )
    p.verify(vocab_size=V)
    assert p.top_k == -1 and p.stop == ["###"] and p.stop_token_ids == [V - 1]
    assert isinstance(p.temperature, float) and p.is_greedy
    q = SamplingParams()
    q.verify()
    assert q.stop == [] and q.stop_token_ids == [] and not q.is_greedy
    assert SamplingParams(top_k=1).is_greedy
    SamplingParams(stop_token_ids=[10**6]).verify()  # no vocab_size: no upper bound


def test_defaults_follow_sglang():
    assert vars(SamplingParams()) == {
        "max_new_tokens": 128,
        "min_new_tokens": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "seed": None,
        "stop": None,
        "stop_token_ids": None,
        "ignore_eos": False,
        "n": 1,
        "return_logprob": False,
        "top_logprobs_num": 0,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "no_stop_trim": False,
        "logit_bias": None,  # SGLang's SamplingParams field
        "logprob_start_len": -1,  # SGLang's GenerateReqInput field; per request here
        "stop_regex": None,
        "return_hidden_states": False,  # SGLang's GenerateReqInput field; per request here
        "sampling_seed": None,
        "custom_params": None,
        "stream_interval": None,
        "beam_width": None,
        "structural_tag": None,
        "watermark": None,
        "json_schema": None,
        "regex": None,
        "ebnf": None,
    }


def test_from_dict_builds_and_verifies():
    p = SamplingParams.from_dict(
        {"temperature": 0.7, "top_k": 0, "stop": "\n", "max_new_tokens": None}
    )
    assert p.temperature == 0.7 and p.top_k == -1 and p.stop == ["\n"] and p.max_new_tokens is None
    assert SamplingParams.from_dict({}) == SamplingParams(stop=[], stop_token_ids=[], stop_regex=[])


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.5})
    assert err.value.param == "temprature"
    assert "temprature" in str(err.value) and "temperature" in str(err.value)
    assert "repetition_penalty" in str(err.value)  # the valid keys are listed
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_dict(["temperature"])
    assert err.value.param == "sampling_params"
