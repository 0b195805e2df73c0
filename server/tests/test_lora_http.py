"""LoRA adapters behind the HTTP server: ``lora_path`` on ``/generate``, the adapter's name as
``model`` on the OpenAI routes (listed by ``/v1/models``), ``/load_lora_adapter`` and
``/unload_lora_adapter`` at run time; PEFT's greedy tokens are the oracle."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from serverproc import start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint, build_lora_adapter, greedy  # noqa: E402

# peft imports triton: not at collection (see tests/test_lora.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft (the LoRA oracle) is not installed")

NEW = 6
PROMPT = list(range(5, 30))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("base"))
    hf = build_checkpoint(base, "llama", seed=1).eval()
    paths, want = {}, {None: greedy(hf, [PROMPT], NEW)[0]}
    for i, (name, rank, targets) in enumerate((("a", 4, ["q_proj", "v_proj", "down_proj"]),
                                               ("b", 8, ["o_proj", "up_proj"]))):
        paths[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        want[name] = greedy(build_lora_adapter(paths[name], hf, rank, 2 * rank, targets, seed=20 + i), [PROMPT],
                            NEW)[0]
    sp = start_server("--model", base, "--dtype", "float32", "--lora-paths", f"a={paths['a']}",
                      "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loras-per-batch", "2")
    yield sp, paths, want
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


def _generate(c, lora_path):
    return c.post("/generate", json={"input_ids": PROMPT, "lora_path": lora_path,
                                     "sampling_params": {"max_new_tokens": NEW, "temperature": 0}})


def test_adapters_by_lora_path_and_by_model_name(lora_server):
    sp, paths, want = lora_server
    with sp.client() as c:
        models = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert models[1:] == ["a"]
        for name in (None, "a"):
            r = _generate(c, name)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want[name]
        text = _generate(c, "a").json()["text"]
        r = c.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "a" and r.json()["choices"][0]["text"] == text
        import openai  # the real client: the adapter's name as the model

        client = openai.OpenAI(base_url=sp.url + "/v1", api_key="none")
        assert "a" in [m.id for m in client.models.list().data]
        out = client.completions.create(model="a", prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert out.model == "a" and out.choices[0].text == text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        r = c.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        r = _generate(c, "nope")
        assert r.status_code == 400 and "unknown adapter 'nope'" in r.json()["error"]["message"]
    sp.wait_idle()


def test_load_and_unload_at_run_time(lora_server):
    sp, paths, want = lora_server
    with sp.client() as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert set(r.json()["loaded_adapters"]) == {"a", "b"}
        assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["a", "b"]
        assert _generate(c, "b").json()["output_ids"] == want["b"]
        r = c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["b"]) + "-missing"})
        assert r.status_code == 400 and "adapter_config.json not found" in r.json()["error"]["message"]
        r = c.post("/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
        assert _generate(c, "b").status_code == 400
        assert c.post("/unload_lora_adapter", json={}).status_code == 400
        assert _generate(c, "a").json()["output_ids"] == want["a"]
    sp.wait_idle()
