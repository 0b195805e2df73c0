"""SGLang's own frontend language (the ``sglang`` package, unchanged) against a live server.

Programs written with ``@sgl.function`` run through ``sgl.RuntimeEndpoint``: ``gen`` with
stop, regex, json_schema and dtype; ``select`` with each choice method; chat roles; ``fork``
and ``join`` over a shared, cached prefix; ``run_batch``; streaming; ``cache_prefix``,
``flush_cache`` and ``get_server_info``. ``.ci/run`` installs the frontend; elsewhere the
module is skipped when it is missing.
"""

from __future__ import annotations

import json
import re

import pytest

sgl = pytest.importorskip("sglang", reason="SGLang's frontend is not installed (scripts/install.sh installs it)")

from radixserve.testing.grammar_conformance import RUNAWAY_MAX_NEW_TOKENS, RUNAWAYS  # noqa: E402
from serverproc import start_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    sp = start_server("--page-size", "1")
    yield sp
    assert sp.stop() == 0, sp.log()


@pytest.fixture(scope="module")
def backend(server):
    be = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")  # SmolLM2's template is ChatML
    sgl.set_default_backend(be)
    return be


def ok(state):
    assert state.error() is None, state.error()
    return state


def generate(server, text: str, **params) -> dict:
    with server.client() as c:
        r = c.post("/generate", json={"text": text, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=24, stop="\n", temperature=0)


def test_gen_with_stop_matches_generate(backend, server):
    state = ok(qa.run(question="What is the capital of France?"))
    answer = state["answer"]
    assert answer and "\n" not in answer
    direct = generate(server, "Q: What is the capital of France?\nA:", max_new_tokens=24, stop="\n", temperature=0)
    assert answer == direct["text"]
    assert state.get_meta_info("answer")["finish_reason"]["type"] in ("stop", "length")


def test_gen_regex_json_schema_and_dtype(backend):
    @sgl.function
    def program(s):
        s += "A three-digit number: "
        s += sgl.gen("digits", regex=r"[0-9]{3}", max_tokens=8)
        s += "\nA person as JSON: "
        s += sgl.gen("person", max_tokens=48, json_schema=json.dumps({
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": False}))
        s += "\nThe number after 41 is "
        s += sgl.gen("n", dtype=int, max_tokens=8)

    state = ok(program.run(temperature=0))
    assert re.fullmatch(r"[0-9]{3}", state["digits"])
    person = json.loads(state["person"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"-?[0-9]+", state["n"])


def test_gen_json_schema_ends_where_the_model_would_loop(backend):
    """``gen(json_schema=...)`` gets the runaway bounds: a free array the model keeps
    filling still closes, as valid JSON, well before max_tokens."""
    _, instruction, schema = next(c for c in RUNAWAYS if c[0] == "free_array")

    @sgl.function
    def program(s):
        s += sgl.user(instruction)
        s += sgl.assistant(sgl.gen("out", max_tokens=RUNAWAY_MAX_NEW_TOKENS, temperature=0,
                                   json_schema=json.dumps(schema)))

    state = ok(program.run())
    meta = state.get_meta_info("out")
    assert meta["finish_reason"]["type"] == "stop", state["out"]
    assert meta["completion_tokens"] < RUNAWAY_MAX_NEW_TOKENS
    assert isinstance(json.loads(state["out"])["items"], list)


@pytest.mark.parametrize("method", ["token_length_normalized", "unconditional_likelihood_normalized",
                                    "greedy_token_selection"])
def test_select_methods(backend, method):
    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", choices=[" Paris", " London", " Berlin"], choices_method=getattr(sgl, method))

    state = ok(capital.run())
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    if method != "greedy_token_selection":
        scores = meta["normalized_prompt_logprobs"]
        assert len(scores) == 3 and all(isinstance(x, float) for x in scores)
    if method == "unconditional_likelihood_normalized":
        assert len(meta["unconditional_token_logprobs"]) == 3
        assert all(row[0][0] is None for row in meta["unconditional_token_logprobs"])  # nothing predicts token 0


def test_chat_roles_use_the_template(backend, server):
    @sgl.function
    def chat(s):
        s += sgl.system("You answer in one word.")
        s += sgl.user("What colour is the sky on a clear day?")
        s += sgl.assistant(sgl.gen("reply", max_tokens=8, temperature=0))

    state = ok(chat.run())
    assert "<|im_start|>assistant\n" in state.text()
    assert state["reply"].strip()


def test_fork_branches_share_the_cached_prefix(backend, server):
    prefix = "Here is a long list of fruits that grow on trees in warm countries: " + ", ".join(
        ["mango", "papaya", "banana", "guava", "lychee", "orange", "lemon", "lime"]) + "."

    @sgl.function
    def branches(s):
        s += prefix
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Fact {i + 1}:" + sgl.gen("fact", max_tokens=6, temperature=0)
        forks.join()
        s["cached"] = [f.get_meta_info("fact")["cached_tokens"] for f in forks]

    state = ok(branches.run())
    prefix_tokens = generate(server, prefix, max_new_tokens=0)["meta_info"]["prompt_tokens"]
    assert prefix_tokens > 32  # the scheduler's in-batch prefix rule (lpm) looks at shared prefixes this long
    # The branches arrive together: one computes the shared prefix, and the others wait a step
    # and find it in the radix cache instead of computing it again.
    hits = sorted(state["cached"])[1:]
    assert all(c >= prefix_tokens - 1 for c in hits), (state["cached"], prefix_tokens)


def test_run_batch_and_streaming(backend):
    states = qa.run_batch([{"question": "What is 2 + 2?"}, {"question": "Name a colour."}])
    answers = [ok(s)["answer"] for s in states]
    assert all(answers)
    streamed = qa.run(question="What is 2 + 2?", stream=True)
    text = "".join(streamed.text_iter("answer"))
    ok(streamed)
    assert text == answers[0]


def test_cache_prefix_flush_cache_and_server_info(backend, server):
    long_prefix = "The history of the printing press begins in the fifteenth century. " * 6
    backend.cache_prefix(long_prefix)
    hit = generate(server, long_prefix + "It", max_new_tokens=1, temperature=0)
    assert hit["meta_info"]["cached_tokens"] > 40
    backend.flush_cache()
    miss = generate(server, long_prefix + "It", max_new_tokens=1, temperature=0)
    assert miss["meta_info"]["cached_tokens"] == 0
    info = backend.get_server_info()
    assert info["model_path"] == backend.get_model_name()
    assert info["served_model_name"]
