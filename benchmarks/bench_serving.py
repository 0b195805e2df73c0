"""Serving benchmark: `radixserve serve` vs `transformers serve --continuous-batching`.

Both servers serve the default model (SmolLM2-135M-Instruct). transformers gets it as a
Hugging Face directory written from radixserve's own loader (dequantised GGUF weights
under their Hugging Face names, a config.json and the tokenizer with its chat template),
so both run the same float32 weights. Each server runs alone on the machine; `radixserve
bench` drives both through /v1/chat/completions with the same seeded prompts. radixserve's
prefix cache is flushed before every run, so no run profits from an earlier one.

    python benchmarks/bench_serving.py [--concurrency 1 8 16 32] [--skip-transformers]
        [--output benchmarks/results/serving.jsonl]

Workloads (kept small for a 2-core CPU):
- shared prefix: `generated-shared-prefix`, 4 groups x 8 questions, 512-token system
  prompt, 32-token questions, 32 output tokens;
- random: 32 prompts of ~200 tokens, 32 output tokens;
- multi-turn: 8 conversations x 4 turns, 64-token user turns, 32 output tokens, every turn
  resending the history.

Next to each run's request/s stands the workload's compute limit on this machine: the
FLOPs of the tokens a server with perfect prefix reuse must still compute (`radixserve
bench`'s `ideal_compute`: every prompt and output merged in one prefix tree; 2 x matmul
parameters per token plus attention over its position) divided by the float32 matmul rate
measured before and after the servers run, the best kept (`bench_roofline.measure_matmul_rate`,
the model's shapes, the engine's threads; the per-run lines use the first measurement), as
requests/s; and the inter-token latency p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_roofline  # noqa: E402 - the roofline's measurements, shared


def export_hf_directory(out_dir: str) -> str:
    """The default model as a Hugging Face directory, written from radixserve's loader."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    ckpt = load_checkpoint(None)
    cfg = ckpt.config
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.to(torch.float32).contiguous() for name, t in ckpt.weights()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        torch_dtype="float32", architectures=["LlamaForCausalLM"])
    hf_cfg.save_pretrained(out_dir)
    tok = load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file)
    tok.hf.chat_template = tok.chat_template
    tok.hf.save_pretrained(out_dir)
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log_path: str, timeout: float = 600.0) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} did not become healthy; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


WORKLOADS = {
    "shared-prefix": ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "4",
                      "--gsp-prompts-per-group", "8", "--gsp-system-prompt-len", "512",
                      "--gsp-question-len", "32", "--gsp-output-len", "32"],
    "random": ["--dataset-name", "random", "--num-prompts", "32", "--random-input-len", "200",
               "--random-output-len", "32"],
    "multi-turn": ["--dataset-name", "multi-turn", "--num-prompts", "8", "--multi-turn-turns", "4",
                   "--multi-turn-input-len", "64", "--multi-turn-output-len", "32"],
}


OUTPUT_LEN = 32  # every workload


def compute_limit(rep: dict, cfg, matmul_rate: float) -> float | None:
    """Requests/s this machine could serve at its float32 matmul rate if only the tokens a
    perfect prefix cache must compute cost anything (None without ``ideal_compute``)."""
    ideal = rep.get("ideal_compute")
    if not ideal or not rep["completed"]:
        return None
    tokens, pos_sum = ideal["tokens"], ideal["position_sum"]
    # a token at position p attends over p + 1 positions
    flops = bench_roofline.model_flops(cfg, tokens) + bench_roofline.attention_flops(cfg, pos_sum + tokens)
    return rep["completed"] / (flops / matmul_rate) if flops else None


def run_bench(url: str, model: str, workload: str, concurrency: int, out_file: str, label: str,
              cfg=None, matmul_rate: float | None = None) -> dict:
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "--base-url", url, "--model", model,
           "--max-concurrency", str(concurrency), "--disable-tqdm", "--output-file", out_file,
           *WORKLOADS[workload]]
    if label == "transformers":
        # transformers serve rejects ignore_eos; a generation_config pins the length instead
        gen = {"min_new_tokens": OUTPUT_LEN, "max_new_tokens": OUTPUT_LEN, "do_sample": False}
        cmd += ["--no-ignore-eos", "--extra-body", json.dumps({"generation_config": json.dumps(gen)})]
    if label != "transformers":  # every run starts with a cold prefix cache (the same prompts repeat)
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        r.raise_for_status()
    before = sum(1 for _ in open(out_file)) if os.path.exists(out_file) else 0
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench failed against {label}:\n{r.stdout}\n{r.stderr}")
    with open(out_file) as fh:
        rep = json.loads(fh.readlines()[before])
    rep["server"] = label
    rep["workload"] = workload
    limit = compute_limit(rep, cfg, matmul_rate) if cfg is not None and matmul_rate else None
    rep["compute_limit_req_s"] = limit
    rep["fraction_of_limit"] = rep["request_throughput"] / limit if limit else None
    lim = f"limit {limit:.3f} ({rep['fraction_of_limit']:.0%})" if limit else "limit n/a"
    print(f"{label:>12} {workload:>13} c={concurrency:<3} req/s {rep['request_throughput']:.3f} {lim}  "
          f"out tok/s {rep['output_throughput']:.1f}  TTFT p50 {rep['ttft_ms']['median']:.0f} ms  "
          f"ITL p50/p99 {rep['itl_ms']['median']:.0f}/{rep['itl_ms']['p99']:.0f} ms  "
          f"hit {rep['cache_hit_rate']}", flush=True)
    return rep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--hf-dir", default=os.path.expanduser("~/.cache/radixserve/smollm2-135m-hf"))
    p.add_argument("--output", default=os.path.join(HERE, "results", "serving.jsonl"))
    p.add_argument("--radixserve-config", action="append", default=None, metavar="LABEL=FLAGS",
                   help="a radixserve server to run, labelled, with extra serve flags (repeatable), e.g. "
                        "'mixed=--enable-mixed-chunk --chunked-prefill-size 256'; default: one with none")
    args = p.parse_args()
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    raw = args.output + ".raw"
    if os.path.exists(raw):
        os.remove(raw)
    # the machine's float32 matmul rate, measured before any server runs (the engine's threads)
    from radixserve.model_loader import load_checkpoint

    cfg = load_checkpoint(None).config
    load_before = os.getloadavg()
    matmul_rate = bench_roofline.measure_matmul_rate(cfg)["best"]
    print(f"float32 matmul rate {matmul_rate / 1e9:.1f} GFLOP/s ({bench_roofline.torch.get_num_threads()} threads), "
          f"load average {load_before[0]:.2f}", flush=True)
    reports = []
    configs = [c.partition("=") for c in args.radixserve_config or ["radixserve="]]
    servers = [(label or "radixserve", None, flags.split()) for label, _, flags in configs]
    if not args.skip_transformers:
        servers.append(("transformers", export_hf_directory(args.hf_dir), []))
    for label, hf_dir, flags in servers:
        port = free_port()
        if hf_dir is None:
            cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
                   "--max-total-tokens", "65536", *flags]
            model = "SmolLM2-135M-Instruct.Q4_1"
        else:
            cmd = ["transformers", "serve", hf_dir, "--continuous-batching", "--port", str(port),
                   "--device", "cpu", "--dtype", "float32"]
            model = hf_dir
        proc = start(cmd, port, f"/tmp/bench_serving_{label}.log")
        try:
            url = f"http://127.0.0.1:{port}"
            for workload in args.workloads:
                for c in args.concurrency:
                    reports.append(run_bench(url, model, workload, c, raw, label, cfg, matmul_rate))
        finally:
            stop(proc)
    # measured again with the servers gone, the best kept (on a busy machine a rate can only come
    # out too low, which would flatter the servers); the final table uses it
    matmul_rate = max(matmul_rate, bench_roofline.measure_matmul_rate(cfg)["best"])
    for rep in reports:
        limit = compute_limit(rep, cfg, matmul_rate)
        rep["compute_limit_req_s"] = limit
        rep["fraction_of_limit"] = rep["request_throughput"] / limit if limit else None
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "matmul_GFLOP_s": matmul_rate / 1e9, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    with open(args.output, "a") as fh:
        for rep in reports:
            fh.write(json.dumps({**rep, "machine": machine, "time": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    print(f"\nfloat32 matmul rate {matmul_rate / 1e9:.1f} GFLOP/s; load average before {load_before}, "
          f"after {machine['loadavg_after']}")
    print("\n| workload | concurrency | server | req/s | compute limit req/s | % of limit | output tok/s | "
          "TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) | cache hit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rep in reports:
        hit, limit, frac = rep["cache_hit_rate"], rep["compute_limit_req_s"], rep["fraction_of_limit"]
        print(f"| {rep['workload']} | {rep['max_concurrency']} | {rep['server']} | {rep['request_throughput']:.3f} | "
              f"{'n/a' if not limit else f'{limit:.3f}'} | {'n/a' if not limit else f'{frac:.0%}'} | "
              f"{rep['output_throughput']:.1f} | {rep['ttft_ms']['median']:.0f} | {rep['itl_ms']['median']:.0f} | "
              f"{rep['itl_ms']['p99']:.0f} | {rep['tpot_ms']['median']:.0f} | "
              f"{'n/a' if hit is None else f'{hit:.0%}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
