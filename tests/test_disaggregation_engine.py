"""Prefill-decode disaggregation between two engines in one process (a tiny random Llama,
each KV transfer engine: mooncake over TCP, torch_dist over gloo, nixl over UCX): the decode
engine's tokens equal one colocated engine's, for several requests at once, greedy and seeded,
with logprobs, a grammar, stop ids and speculative decoding; a prefill server that never
answers, a reused room, KV that fails its checksum and a flood fail the request alone; both
engines end idle with no leaked page."""

from __future__ import annotations

import concurrent.futures
import os
import random
import socket

import pytest
import radixserve
from engine_checks import wait_until_idle
from radixserve.engine.scheduler import RequestRejected
from radixserve.registry import get_registry
from tiny_models import build_checkpoint

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # torch_dist's TCPStore looks peers up in DNS
TRANSPORTS = ("mooncake", "torch_dist", "nixl")
GREEDY5 = {"max_new_tokens": 5, "temperature": 0.0}
COMMON = dict(dtype="float32", max_total_tokens=2048, enable_leak_check=True, disaggregation_transfer_timeout=5.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=TRANSPORTS)
def engines(request, tmp_path_factory):
    reason = get_registry().get("kv_transfer", request.param).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{request.param} transfer engine unavailable: {reason}")
    path = str(tmp_path_factory.mktemp("tiny_disagg"))
    build_checkpoint(path, "llama", seed=11, max_position_embeddings=512)
    port = free_port()
    common = dict(COMMON, disaggregation_transfer_backend=request.param)
    prefill = radixserve.Engine(path, disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **common)
    decode = radixserve.Engine(path, disaggregation_mode="decode", page_size=4, **common)
    single = radixserve.Engine(path, **COMMON)
    yield prefill, decode, single, port
    for e in (prefill, decode, single):
        e.shutdown()


def disaggregated(prefill, decode, port, ids, params, room=None):
    """What SGLang's router does: the same request to both servers, with one bootstrap room."""
    room = random.getrandbits(63) if room is None else room
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.generate, input_ids=ids, sampling_params=params, **boot)
        d = pool.submit(decode.generate, input_ids=ids, sampling_params=params, **boot)
        return p.result(), d.result()


def test_decode_tokens_equal_one_engine(engines):
    prefill, decode, single, port = engines
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 40, 33, 64)]
    cases = [{"max_new_tokens": 12, "temperature": 0.0},
             {"max_new_tokens": 9, "temperature": 0.8, "sampling_seed": 7},
             {"max_new_tokens": 6, "temperature": 0.0, "return_logprob": True, "top_logprobs_num": 2}]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [(ids, params, pool.submit(disaggregated, prefill, decode, port, ids, params))
                for ids in prompts for params in cases]
        for ids, params, job in jobs:
            first, out = job.result()
            want = single.generate(input_ids=ids, sampling_params=params)
            assert out["output_ids"] == want["output_ids"], (len(ids), params)
            assert first["output_ids"] == want["output_ids"][:1]  # the prefill server answers its one token
            if params.get("return_logprob"):
                got = out["meta_info"]["output_token_logprobs"]
                ref = want["meta_info"]["output_token_logprobs"]
                assert [t[1] for t in got] == [t[1] for t in ref]
                assert [t[0] for t in got] == pytest.approx([t[0] for t in ref], abs=1e-4)
    for e in (prefill, decode):
        wait_until_idle(e)
        e.check_idle_invariant()
    stats = decode.get_stats()
    assert stats["num_disagg_received"] >= len(jobs) and stats["num_disagg_waiting_reqs"] == 0
    assert prefill.get_stats()["num_disagg_sent"] >= len(jobs)


def test_without_a_prefill_server_the_request_fails_alone(engines):
    prefill, decode, single, port = engines
    dead = free_port()
    out = decode.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4},
                          bootstrap_host="127.0.0.1", bootstrap_port=dead, bootstrap_room=1)
    assert out["meta_info"]["finish_reason"]["status_code"] == 503
    assert "bootstrap" in out["meta_info"]["finish_reason"]["message"]
    ids = [9, 8, 7, 6]
    assert disaggregated(prefill, decode, port, ids, GREEDY5)[1]["output_ids"] == \
        single.generate(input_ids=ids, sampling_params=GREEDY5)["output_ids"]


def test_a_reused_room_is_refused(engines):
    prefill, decode, single, port = engines
    room = random.getrandbits(63)
    disaggregated(prefill, decode, port, [4, 5, 6], {"max_new_tokens": 3}, room=room)
    again = prefill.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 3},
                             bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room)
    reason = again["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "already in use" in reason["message"]
    with pytest.raises(RequestRejected, match="one sequence"):
        prefill.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 3, "n": 2},
                         bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room + 1)


def once(engines) -> None:
    """Core paths whatever the transport: checked with mooncake only (the suite's time)."""
    if engines[0].server_args.disaggregation_transfer_backend != "mooncake":
        pytest.skip("a path of the core, whatever the transport: checked once, with mooncake")


def test_grammar_and_stop_strings_on_the_decode_side(engines):
    once(engines)
    prefill, decode, single, port = engines
    ids = [12, 40, 7, 99, 3]
    for params in ({"max_new_tokens": 8, "temperature": 0.0, "regex": "w1[0-9]"},  # one token, then the end
                   {"max_new_tokens": 16, "temperature": 0.0, "stop_token_ids": [50, 60, 70, 80]},
                   {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True, "min_new_tokens": 4}):
        want = single.generate(input_ids=ids, sampling_params=params)
        got = disaggregated(prefill, decode, port, ids, params)[1]
        assert got["output_ids"] == want["output_ids"], params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], params
        if "regex" in params:  # the grammar chose the prefill server's token and ended it here
            assert 10 <= got["output_ids"][0] <= 19 and got["meta_info"]["finish_reason"]["type"] == "stop"


def test_kv_that_does_not_match_its_checksum_fails_the_request(engines, monkeypatch):
    once(engines)
    prefill, decode, single, port = engines
    handlers = decode.scheduler.disagg.group._handlers  # the decode side's checksum of what arrived
    real = handlers["checksum"]
    monkeypatch.setitem(handlers, "checksum", lambda p: [[i, c ^ 1] for i, c in real(p)])  # one flipped bit
    out = disaggregated(prefill, decode, port, [3, 1, 4, 1, 5], {"max_new_tokens": 4})[1]
    reason = out["meta_info"]["finish_reason"]
    assert reason["status_code"] == 500 and "checksum" in reason["message"] and out["output_ids"] == []
    monkeypatch.setitem(handlers, "checksum", real)
    wait_until_idle(decode, timeout=15)  # its pages are kept aside for the transfer timeout, then freed


def test_speculative_decoding_on_the_decode_side(engines):
    """NGRAM on the decode server, over a prompt whose KV arrived from the prefill server,
    drafts exactly what NGRAM on one server drafts, and stays lossless."""
    prefill, _, single, port = engines
    transport = prefill.server_args.disaggregation_transfer_backend
    common = dict(COMMON, speculative_algorithm="NGRAM")
    spec = radixserve.Engine(prefill.server_args.model, disaggregation_mode="decode",
                             **dict(common, disaggregation_transfer_backend=transport))
    alone = radixserve.Engine(prefill.server_args.model, **common)
    try:
        ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # a prompt an n-gram draft can follow
        params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        got = disaggregated(prefill, spec, port, ids, params)[1]
        assert got["output_ids"] == single.generate(input_ids=ids, sampling_params=params)["output_ids"]
        alone.generate(input_ids=ids, sampling_params=params)
        drafted = [e.get_stats()["spec_num_draft_tokens"] for e in (spec, alone)]
        assert drafted[0] == drafted[1] > 0
        wait_until_idle(spec)
    finally:
        spec.shutdown()
        alone.shutdown()


def test_requests_waiting_for_their_kv_count_against_the_queue_cap(engines):
    once(engines)
    prefill, _, _, port = engines
    transport = prefill.server_args.disaggregation_transfer_backend
    capped = radixserve.Engine(prefill.server_args.model, disaggregation_mode="decode", max_queued_requests=1,
                               **dict(COMMON, disaggregation_transfer_backend=transport,
                                      disaggregation_transfer_timeout=2.0))
    try:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        params = {"max_new_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # the prefill server never sees this one: it waits for its KV until the timeout
            waiting = pool.submit(capped.generate, input_ids=[1, 2, 3], sampling_params=params,
                                  bootstrap_room=random.getrandbits(63), **boot)
            while capped.get_stats()["num_disagg_waiting_reqs"] == 0:
                assert not waiting.done()
            refused = capped.generate(input_ids=[4, 5, 6], sampling_params=params,
                                      bootstrap_room=random.getrandbits(63), **boot)
            assert refused["meta_info"]["finish_reason"]["status_code"] == 429
            assert waiting.result()["meta_info"]["finish_reason"]["status_code"] == 503
        wait_until_idle(capped, timeout=10)
    finally:
        capped.shutdown()


def test_transfer_flags_reach_the_engine_or_are_refused(tmp_path):
    from radixserve.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="--disaggregation-transfer-backend-extra-config"):
        ServerArgs(disaggregation_mode="decode", disaggregation_transfer_backend_extra_config="{not json")
    with pytest.raises(ConfigError, match="--disaggregation-mode"):
        ServerArgs(disaggregation_mode="both")
    reason = get_registry().get("kv_transfer", "nixl").unavailable_reason()
    if reason is not None:
        pytest.skip(f"nixl transfer engine unavailable: {reason}")
    build_checkpoint(str(tmp_path), "llama", seed=11, max_position_embeddings=512)
    port = free_port()
    engine = radixserve.Engine(str(tmp_path), disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
                               disaggregation_host="127.0.0.1",
                               disaggregation_transfer_backend_extra_config=f'{{"port": {port}}}', **COMMON)
    try:  # the extra config's port and the host are the transfer engine's address
        assert engine.scheduler.disagg.transfer.address().endswith(f"@127.0.0.1:{port}")
    finally:
        engine.shutdown()
