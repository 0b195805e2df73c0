"""Per-request cost bounds (``radixserve.config.limits``): each over-limit field is refused
naming the field and the flag, each at-limit request works, and the per-request structures
the scheduler reads every step (logit-bias tensors, stop-id set and tensor) are built once."""

from __future__ import annotations

import pytest
from engine_checks import leak_checked_engine
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.scheduler import RequestRejected
from radixserve.sampling import InvalidSamplingParams, SamplingParams
from tiny_models import VOCAB, build_checkpoint, random_prompts

LIMITS = {"max_stop_strings": 3, "max_stop_chars": 12, "max_stop_token_ids": 4, "max_logit_bias": 5,
          "max_request_prompt_tokens": 100}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("limits_llama"))
    build_checkpoint(path, "llama", seed=2, max_position_embeddings=512)
    with leak_checked_engine(path, **LIMITS) as e:
        yield e


PROMPT = random_prompts(1, 20, seed=4)[0]


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("stop", ["a", "b", "c", "d"], "--max-stop-strings"),
    ("stop", ["abcdefg", "hijklmn"], "--max-stop-chars"),
    ("stop_token_ids", [1, 2, 3, 4, 5], "--max-stop-token-ids"),
    ("logit_bias", {str(t): 1.0 for t in range(6)}, "--max-logit-bias"),
])
def test_over_limit_fields_are_refused_naming_field_and_flag(engine, field, value, flag):
    with pytest.raises(InvalidSamplingParams) as e:
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, field: value})
    assert e.value.param == field and flag in str(e.value)


def test_n_times_prompt_is_bounded(engine):
    with pytest.raises(RequestRejected) as e:
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1, "n": 6})  # 6 x 20 > 100
    assert e.value.param == "n" and "--max-request-prompt-tokens" in str(e.value)
    with pytest.raises(RequestRejected):  # summed over a batch's prompts
        engine.generate(input_ids=[PROMPT] * 3, sampling_params={"max_new_tokens": 1, "n": 2})
    outs = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1, "n": 5})  # exactly 100
    assert len(outs) == 5


class CountingDict(dict):
    reads = 0

    def _read(self, name):
        CountingDict.reads += 1
        return getattr(super(), name)()

    def keys(self):
        return self._read("keys")

    def values(self):
        return self._read("values")

    def items(self):
        return self._read("items")


class CountingList(list):
    reads = 0

    def __iter__(self):
        CountingList.reads += 1
        return super().__iter__()

    def __contains__(self, item):
        CountingList.reads += 1
        return super().__contains__(item)


def test_at_limit_request_works_and_its_structures_are_built_once(engine, monkeypatch):
    from radixserve.sampling import params as params_mod

    base = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True})["output_ids"]
    forced = (base[0] + 1) % VOCAB
    stop_ids = [t for t in range(VOCAB) if t not in base and t != forced][:4]
    # what verify() makes of logit_bias and stop_token_ids counts every later read: a few
    # when the request is built, none per step (12 steps)
    bias_of, ids_of = params_mod._logit_bias, params_mod._token_id_list
    monkeypatch.setattr(params_mod, "_logit_bias", lambda *a: CountingDict(bias_of(*a) or {}))
    monkeypatch.setattr(params_mod, "_token_id_list", lambda *a: CountingList(ids_of(*a)))
    CountingDict.reads = CountingList.reads = 0
    out = engine.generate(input_ids=PROMPT, sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "min_new_tokens": 12,
        "stop": ["x" * 4, "y" * 4, "z" * 4], "stop_token_ids": stop_ids,
        "logit_bias": {str(forced): 100.0, **{str(t): -100.0 for t in stop_ids}}})
    assert out["output_ids"] == [forced] * 12  # the bias applied every step
    assert CountingDict.reads <= 4, f"logit_bias read {CountingDict.reads} times over 12 steps"
    assert CountingList.reads <= 4, f"stop_token_ids read {CountingList.reads} times over 12 steps"


def test_limit_flags_are_checked():
    for name in LIMITS:
        with pytest.raises(ConfigError, match=name.replace("_", "-")):
            ServerArgs(**{name: 0})


def test_cache_report_off_hides_cached_tokens_but_not_from_the_stats(tmp_path):
    build_checkpoint(str(tmp_path), "llama", seed=2, max_position_embeddings=512)
    prompt = random_prompts(1, 40, seed=9)[0]
    with leak_checked_engine(str(tmp_path), cache_report="off", page_size=4) as engine:
        outs = [engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1}) for _ in range(2)]
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
        assert engine.get_stats()["num_cached_prompt_tokens"] >= 36  # the second one was served from the cache
    with pytest.raises(ConfigError, match="--cache-report"):
        ServerArgs(cache_report="hidden")


def test_default_limits_refuse_the_audited_requests():
    """What slowed every stream 4x before the bounds existed: 100k stop strings, a
    full-vocabulary logit_bias (49,152 ids: the default model's)."""
    from radixserve.sampling.limits import check_fields

    defaults = ServerArgs().limit_args
    for field, value in (("stop", [f"s{i}" for i in range(100_000)]),
                         ("logit_bias", {t: 1.0 for t in range(49152)}),
                         ("stop_token_ids", list(range(49152)))):
        p = SamplingParams(**{field: value})
        p.verify(49152)
        with pytest.raises(InvalidSamplingParams) as e:
            check_fields(p, defaults)
        assert e.value.param == field
