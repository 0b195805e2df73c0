"""Disconnecting clients, SIGTERM draining, start-up errors and the benchmark client."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cli_guard import assert_not_loaded, run_without_loading
from serverproc import start_server

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


def _drop_after(server, chunks: int, body: dict, path: str = "/generate") -> int:
    """Stream a request and close the connection after ``chunks`` SSE events."""
    seen = 0
    with server.client() as c, c.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break
    return seen


def _drop_before_first_token(server, body: dict) -> None:
    """Send a request on a raw socket and close it right away."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        headers = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n")
        if server.api_key:
            headers += f"Authorization: Bearer {server.api_key}\r\n"
        s.sendall(headers.encode() + b"\r\n" + payload)
        time.sleep(0.05)


def test_disconnecting_clients_release_their_pages(server):
    neighbour: dict = {}

    def run_neighbour():
        with server.client() as c:
            neighbour["r"] = c.post("/generate", json={"text": "The quick brown fox",
                                                       "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                           "ignore_eos": True}})

    threads = [threading.Thread(target=_drop_after, args=(server, 2 + i % 3, {
        "text": f"Story number {i}: once upon a time", "stream": True, "sampling_params": LONG}))
        for i in range(8)]
    threads += [threading.Thread(target=_drop_after, args=(server, 3, {
        "messages": [{"role": "user", "content": f"Chat {i}"}], "max_tokens": 400, "ignore_eos": True,
        "stream": True}, "/v1/chat/completions")) for i in range(2)]
    # before the first token: long prompts whose prefill is still running when the socket closes
    threads += [threading.Thread(target=_drop_before_first_token, args=(server, {
        "input_ids": list(range(2000 + i, 3500 + i)), "sampling_params": LONG})) for i in range(3)]
    # a non-streaming request whose client times out mid-generation
    def timeout_client():
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, headers=server.headers,
                                                           timeout=1.0) as c:
            c.post("/generate", json={"text": "A long answer:", "sampling_params": LONG})

    threads.append(threading.Thread(target=timeout_client))
    threads.append(threading.Thread(target=run_neighbour))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    r = neighbour["r"]
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 16
    # every dropped request was aborted well before its 400 tokens, and nothing leaked
    server.wait_idle(timeout=60)
    with server.client() as c:
        stats = c.get("/get_server_info").json()["stats"]
    assert stats["num_aborted_reqs"] >= 13
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0


def test_sigterm_drains_then_exits_zero():
    sp = start_server("--shutdown-timeout", "4")
    try:
        results: dict = {}

        def short():
            with sp.client() as c:
                results["short"] = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 12,
                                                                    "ignore_eos": True, "temperature": 0})

        def long():
            with sp.client() as c:
                results["long"] = c.post("/generate", json={"text": "Go on forever",
                                                            "sampling_params": {"max_new_tokens": 3000,
                                                                                "ignore_eos": True}})

        threads = [threading.Thread(target=short), threading.Thread(target=long)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        sp.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(sp.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(sp.url + "/health", timeout=10).status_code == 503
        for t in threads:
            t.join(120)
        code = sp.proc.wait(60)
    finally:
        sp.stop(signal.SIGKILL)
    # in flight when the signal came: the short one finished, the long one was aborted at the timeout
    assert results["short"].status_code == 200
    assert results["short"].json()["choices"][0]["finish_reason"] == "length"
    long_out = results["long"].json()
    assert long_out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < long_out["meta_info"]["completion_tokens"] < 3000
    # exit 0 also means the engine found every KV page free or cached when it stopped
    assert code == 0, sp.log()


@pytest.mark.parametrize("argv, message", [
    (["--attention-backend", "nope"], "--attention-backend"),
    (["--port", "70000"], "--port"),
    (["--dtype", "int3"], "--dtype"),
    (["--max-batch-prompts", "0"], "--max-batch-prompts"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--max-consecutive-failed-steps", "0"], "--max-consecutive-failed-steps"),
    (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
])
def test_bad_serve_flags(argv, message):
    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert message in r.stderr
    if argv[0] == "--attention-backend":
        assert "torch_native" in r.stderr  # the valid choices are listed


def test_bench_against_the_server(server, tmp_path):
    out = tmp_path / "bench.jsonl"
    base = [sys.executable, "-m", "radixserve.cli", "bench", "--base-url", server.url, "--api-key",
            server.api_key, "--disable-tqdm", "--output-file", str(out)]
    runs = [
        ["--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
         "--max-concurrency", "2"],
        ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
         "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "4",
         "--max-concurrency", "1", "--endpoint", "completions"],
        ["--dataset-name", "multi-turn", "--num-prompts", "2", "--multi-turn-turns", "2",
         "--multi-turn-input-len", "8", "--multi-turn-output-len", "4", "--request-rate", "20"],
    ]
    # the first run through the command line, the others in-process (saves start-up time)
    r = subprocess.run(base + runs[0], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "output throughput" in r.stdout
    from radixserve_server.bench import add_arguments, bench_command

    for argv in runs[1:]:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert bench_command(parser.parse_args(base[4:] + argv)) == 0
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rep["completed"] for rep in reports] == [4, 6, 4]
    assert all(rep["failed"] == 0 for rep in reports)
    for rep in reports:
        assert rep["total_output_tokens"] == 4 * rep["completed"]  # ignore_eos: exact lengths
        assert rep["ttft_ms"]["median"] > 0 and rep["output_throughput"] > 0
    # run one at a time, each group's later questions hit its cached system prompt
    assert reports[1]["cache_hit_rate"] > 0.3
    for rep in reports:  # what a perfect prefix cache must still compute
        assert 0 < rep["ideal_compute"]["tokens"] < rep["total_input_tokens"] + rep["total_output_tokens"]
    # the shared system prompts count once
    assert reports[1]["ideal_compute"]["tokens"] < reports[1]["total_input_tokens"]
    server.wait_idle()


def test_ideal_compute_counts_each_prefix_once():
    from radixserve_server.bench import ideal_compute

    # two answers to one prompt [1, 2]: the prompt once, no final output token is fed back
    assert ideal_compute([[1, 2, 3], [1, 2, 4]]) == {"tokens": 2, "position_sum": 0 + 1}
    # a second turn extends the first: the first turn's last output token is computed then
    assert ideal_compute([[1, 2, 3], [1, 2, 3, 5, 6]]) == {"tokens": 4, "position_sum": 0 + 1 + 2 + 3}
    assert ideal_compute([[7]]) == {"tokens": 0, "position_sum": 0}


# ------------------------------------------------- shutdown in any order
@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGTERM)],
                         ids=["sigint-sigint", "sigterm-sigint", "sigterm-sigterm"])
def test_second_signal_answers_in_flight_requests_cleanly(first, second):
    """A second signal while draining ends every in-flight request at once with a 503 and an
    OpenAI-style body (a started stream: SSE error event, then [DONE]), then exits 0 with no
    traceback (the reader thread must not trip over the closed event loop)."""
    from test_engine_death import Opened, engine_pid, kill_quietly, open_mix, wait_gone

    sp = start_server("--shutdown-timeout", "60")
    pid = None
    try:
        pid = engine_pid(sp)
        opened = open_mix(sp, n_streams=2, n_plain=1)
        sp.proc.send_signal(first)
        time.sleep(0.5)
        assert sp.proc.poll() is None  # draining: the long requests keep running
        late = Opened(sp, "/v1/completions", {"prompt": "late", "max_tokens": 2}, stream=False)
        late.join(10)
        stopped = time.monotonic()
        sp.proc.send_signal(second)
        code = sp.proc.wait(15)
        exited = time.monotonic() - stopped
        for o in opened:
            o.join(10)
        engine_gone = wait_gone(pid, 10)
    finally:
        sp.stop(signal.SIGKILL)
        if pid is not None:
            kill_quietly(pid)
    log = sp.log()
    late.assert_failed_with(503, "shutting down")
    for o in opened:
        o.assert_failed_with(503, "stopped")
        assert o.ended_at - stopped < 3.0
    assert code == 0, log
    assert exited < 8.0
    assert engine_gone
    assert "Traceback" not in log and "RuntimeError" not in log, log


# ------------------------------------- cheap checks before the model loads
@pytest.mark.parametrize("case", ["port-taken", "host-not-here"])
def test_bad_listen_address_fails_before_loading(case):
    """An occupied port or an address this machine does not have is reported at once (the
    socket is bound before the checkpoint, tokenizer and engine load), naming the flag."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--port", str(port)] if case == "port-taken" else ["--host", "203.0.113.7", "--port", "0"]
        r = run_without_loading("serve", *args)
    assert_not_loaded(r)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixserve: error: "), r.stderr
    assert ("--port" if case == "port-taken" else "--host") in lines[0]
    assert "in use" in lines[0] if case == "port-taken" else "203.0.113.7" in lines[0]


def test_bench_without_a_server_names_the_url():
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()  # nothing listens there
    r = run_without_loading("bench", "--base-url", url, "--disable-tqdm")
    assert_not_loaded(r)  # the URL is tried before the tokenizer loads
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip() == f"radixserve: error: cannot reach {url}: connection refused", r.stderr
    assert r.stdout == ""
