"""HiCache storage pays off by default: a server restarted on the file tier's directory
serves a long stored prompt from storage on its first request, with the default prefetch
policy (``auto``) and no other flag, and gives the same greedy tokens as the server that
computed it. The default model; ``--enable-hierarchical-cache --hicache-storage-backend
file --hicache-storage-dir D`` and nothing else."""

from __future__ import annotations

import pytest
from serverproc import start_server

pytestmark = pytest.mark.slow

PROMPT = "".join(f"Item {i} of the list is {'even' if i % 2 == 0 else 'odd'} and {i * i} is its square. "
                 for i in range(70))


def first_request(storage_dir) -> tuple[dict, dict]:
    sp = start_server("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                      "--hicache-storage-dir", str(storage_dir))
    try:
        with sp.client() as c:
            r = c.post("/generate", json={"text": PROMPT, "sampling_params": {
                "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            info = c.get("/server_info").json()
    finally:
        assert sp.stop() == 0, sp.log()  # a clean shutdown lands the pending storage writes
    return r.json(), info


def test_a_restarted_server_serves_a_long_prompt_from_storage(tmp_path):
    first, _ = first_request(tmp_path)
    prompt_tokens = first["meta_info"]["prompt_tokens"]
    assert 1000 <= prompt_tokens <= 1300, prompt_tokens
    assert first["meta_info"]["cached_tokens"] == 0
    second, info = first_request(tmp_path)  # a fresh process: device and host tiers are empty
    assert second["meta_info"]["cached_tokens"] >= 0.9 * prompt_tokens, (second["meta_info"], info)
    assert second["output_ids"] == first["output_ids"]
    assert second["text"] == first["text"]
