"""Cost growth with model size: random-weight ~1B and ~0.5B GGUF models next to the default model.

Writes random-weight models as GGUF files with gguf-py (``gguf.GGUFWriter``, ``gguf.quants``)
under llama.cpp's tensor and metadata names, then measures each file in its own subprocess
(so that memory is per model):

* ``llama-1b``: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim
  64, intermediate 8192, vocab 128256, tied embeddings, rope theta 500000);
* ``qwen2-0.5b``: Qwen2-0.5B's shape (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864,
  vocab 151936, QKV bias, tied embeddings, rope theta 1000000);
* ``tiny``: hidden 64, 2 layers (the test's configuration).

Weights: normal x 0.02 (embedding and every matrix), QKV biases normal x 0.02, norms 1.
Quantizations ``Q4_0``, ``Q4_1``, ``Q8_0``, ``F16``: the linear weights in that type, norms and
biases float32; the (tied) token embedding Q8_0 in the Q4_0/Q4_1/Q8_0 files, as the default
SmolLM2 Q4_1 file carries it, and F16 in the F16 file, as llama.cpp's ``--outtype f16``
conversion keeps it. Q/K rows of ``llama`` are interleaved as llama.cpp's converter does.

Tokenizer: the default model's GGUF tokenizer metadata (SmolLM2's 49152-token byte-level BPE,
merges, special ids, chat template) is copied into each file; a vocabulary larger than that is
padded with ``<|reserved_N|>`` tokens (ordinary tokens that no text encodes to), so the
tokenizer covers every id the model can emit. The benchmark feeds token ids, so only its
loading matters (converted once per file, then cached by radixserve).

Per file (``--measure``, one subprocess each): file size; peak RSS while the engine starts
(VmHWM, reset just before) and RssAnon / RssFile after it started; the KV pool
(``--max-total-tokens`` fixed so the pool is small and the same for every model) and KV bytes
per token; decode step ms at batch 1 and 16 (``bench_roofline.time_decode_steps``) and the
share of the weight-read bound (``decode_weight_bytes`` / measured bandwidth) / step ms;
prefill tok/s for one 512-token prompt (best of 2, wall time of ``generate`` with one new
token); serving: 16 requests of 128-token prompts and 64 new tokens in one offline
``Engine.generate`` call (req/s, output tok/s).

    python benchmarks/bench_scaling.py [--models llama-1b,qwen2-0.5b] [--quantizations Q4_1,Q8_0,F16]
        [--no-default] [--keep DIR] [--output result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    qkv_bias: bool
    rms_eps: float = 1e-5
    context: int = 8192  # written as {arch}.context_length (as the default model's)
    scale: float = 0.02  # std of every matrix and bias


MODELS = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, False),
    "qwen2-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 151936, 1000000.0, True, rms_eps=1e-6),
    "tiny": Shape("llama", 64, 2, 4, 2, 16, 128, 49152, 10000.0, False, context=1024),
}
QUANTIZATIONS = ("Q4_0", "Q4_1", "Q8_0", "F16")
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def hf_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes of the model's tensors, in file order (tied embeddings)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (s.hidden,)), (p + "self_attn.q_proj.weight", (q, s.hidden)),
                (p + "self_attn.k_proj.weight", (kv, s.hidden)), (p + "self_attn.v_proj.weight", (kv, s.hidden))]
        if s.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        out += [(p + "self_attn.o_proj.weight", (s.hidden, q)), (p + "post_attention_layernorm.weight", (s.hidden,)),
                (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
                (p + "mlp.down_proj.weight", (s.hidden, s.intermediate))]
    return out + [("model.norm.weight", (s.hidden,))]


def hf_tensor(s: Shape, index: int, name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """The float32 value of tensor ``index`` (its own generator: any subset reproduces)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(s.scale)


def ggml_type(name: str, shape: tuple[int, ...], quant: str):
    """The GGUF type a tensor is stored in, in a file of quantization ``quant``."""
    from gguf import GGMLQuantizationType as T

    if len(shape) == 1:
        return T.F32
    if name == "model.embed_tokens.weight":
        return T.F16 if quant == "F16" else T.Q8_0
    return T[quant]


def encode(data: np.ndarray, qtype) -> np.ndarray:
    """The tensor's stored data: float32/float16 values or quantized blocks (uint8)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    return quants.quantize(data, qtype)


def stored_value(data: np.ndarray, qtype) -> np.ndarray:
    """What a reader dequantizes the stored tensor to (float32), for oracles."""
    from gguf import quants

    return np.asarray(quants.dequantize(encode(data, qtype), qtype), dtype=np.float32).reshape(data.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def to_file_layout(s: Shape, hf: str, data: np.ndarray) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two RoPE halves in Llama's Q/K rows."""
    if s.arch != "llama" or not hf.endswith(("q_proj.weight", "k_proj.weight")):
        return data
    n = s.heads if "q_proj" in hf else s.kv_heads
    return data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def _add_metadata(w, s: Shape, tokenizer: dict) -> None:
    w.add_name(f"random {s.arch} h{s.hidden} L{s.layers} (radixserve bench_scaling)")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_theta)
    w.add_vocab_size(s.vocab)
    f = tokenizer
    tokens, types = list(f["tokenizer.ggml.tokens"]), list(f["tokenizer.ggml.token_type"])
    pad = range(len(tokens), s.vocab)
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in f:
        w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(tokens + [f"<|reserved_{i}|>" for i in pad])
    w.add_token_types(types + [1] * len(pad))  # 1: an ordinary token
    w.add_token_merges(f["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("unknown_token_id", w.add_unk_token_id), ("padding_token_id", w.add_pad_token_id),
                     ("add_bos_token", w.add_add_bos_token), ("add_space_prefix", w.add_add_space_prefix)):
        if f"tokenizer.ggml.{key}" in f:
            add(f[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in f:
        w.add_chat_template(f["tokenizer.chat_template"])


def default_tokenizer_fields() -> dict:
    from radixserve.model_loader import default_model_path
    from radixserve.model_loader.gguf_reader import GGUFHeader

    fields = GGUFHeader(default_model_path()).fields
    return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


def write_models(s: Shape, quants: list[str], out_dir: str, stem: str, seed: int = 0) -> dict[str, str]:
    """Write one GGUF file per quantization (``{stem}.{quant}.gguf``), generating each tensor once."""
    import gguf

    tokenizer = default_tokenizer_fields()
    names = hf_shapes(s)
    paths = {q: os.path.join(out_dir, f"{stem}.{q}.gguf") for q in quants}
    writers = {}
    for q, path in paths.items():
        w = gguf.GGUFWriter(path, s.arch)
        _add_metadata(w, s, tokenizer)
        w.add_file_type(int(getattr(gguf.LlamaFileType, "MOSTLY_" + q, gguf.LlamaFileType.ALL_F32)))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for hf, shape in names:
            t = ggml_type(hf, shape, q)
            if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dtype = np.float32 if t == gguf.GGMLQuantizationType.F32 else np.float16
                w.add_tensor_info(gguf_name(hf), shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(shape, t)
                w.add_tensor_info(gguf_name(hf), byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        writers[q] = w
    for i, (hf, shape) in enumerate(names):
        data = to_file_layout(s, hf, hf_tensor(s, i, hf, shape, seed))
        for q, w in writers.items():
            w.write_tensor_data(encode(data, ggml_type(hf, shape, q)))
    for w in writers.values():
        w.close()
    return paths


# ---------------------------------------------------------------- measuring one file (subprocess)
def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def measure(path: str, max_total_tokens: int, decode_steps: int, serve: tuple[int, int, int],
            engine_args: dict | None = None) -> dict:
    import radixserve  # noqa: F401  (imported before the peak is reset: not part of loading)
    import torch
    import transformers  # noqa: F401

    sys.path.insert(0, HERE)
    from bench_roofline import measure_bandwidth, time_decode_steps
    from radixserve import Engine
    from radixserve.mem.kv_pool import KVPool

    before = proc_status()
    peak_reset = reset_peak_rss()
    t = time.perf_counter()
    # --max-total-tokens 0: the pool the default flags size from the memory left after the weights
    engine = Engine(model=path, disable_radix_cache=True, max_total_tokens=max_total_tokens or None,
                    **(engine_args or {}))
    load_s = time.perf_counter() - t
    loaded = proc_status()
    runner, cfg = engine.runner, engine.runner.model_config
    per_token = KVPool.bytes_per_token_for(cfg.num_hidden_layers, runner.heads.num_kv_heads, cfg.head_dim,
                                           runner.kv_dtype)
    row = {"path": path, "file_bytes": os.path.getsize(path), "load_s": load_s, "peak_reset": peak_reset,
           "rss_before": before["VmRSS"], "peak_rss": loaded["VmHWM"], "rss_anon": loaded["RssAnon"],
           "rss_file": loaded["RssFile"], "kv_bytes_per_token": per_token,
           "kv_pool_bytes": runner.max_total_tokens * per_token, "weight_bytes": runner.weight_bytes,
           "decode_weight_bytes": runner.decode_weight_bytes, "threads": torch.get_num_threads()}
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params={"max_new_tokens": 4, **greedy})  # warm-up
    bandwidth = measure_bandwidth(size_mb=512)
    row["decode"] = {bs: time_decode_steps(engine, bs, 32, decode_steps) for bs in (1, 16)}
    bandwidth = max(bandwidth, measure_bandwidth(size_mb=512))
    row["bandwidth_B_s"] = bandwidth
    read_ms = runner.decode_weight_bytes / bandwidth * 1000
    row["weight_read_bound_ms"] = read_ms
    for d in row["decode"].values():
        d["roofline_share"] = read_ms / d["step_ms"]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, 40000, (512,), generator=gen).tolist()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, **greedy})
        times.append(time.perf_counter() - t)
    row["prefill_tok_s"] = len(prompt) / min(times)
    n, plen, new = serve
    ids = torch.randint(100, 40000, (n, plen), generator=gen).tolist()
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new, **greedy})
    dt = time.perf_counter() - t
    row["serve"] = {"requests": n, "prompt_len": plen, "new_tokens": new, "seconds": dt, "req_s": n / dt,
                    "out_tok_s": sum(len(o["output_ids"]) for o in outs) / dt}
    row["rss_after_runs"] = proc_status()["VmRSS"]
    engine.shutdown()
    return row


# ---------------------------------------------------------------- driver
def _table(rows: list[tuple[str, dict]]) -> str:
    mib = 2**20
    lines = ["| model | file MiB | load peak RSS MiB (start → peak) | RssAnon / RssFile MiB | KV B/token "
             "| KV pool MiB | RSS after runs − before ÷ (file + KV pool) "
             "| decode b1 ms (share) | decode b16 ms (share) | prefill 512 tok/s | serve req/s | serve out tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        d1, d16 = r["decode"]["1"], r["decode"]["16"]
        lines.append(
            f"| {name} | {r['file_bytes'] / mib:.0f} | {r['rss_before'] / mib:.0f} → {r['peak_rss'] / mib:.0f} "
            f"| {r['rss_anon'] / mib:.0f} / {r['rss_file'] / mib:.0f} | {r['kv_bytes_per_token']} "
            f"| {r['kv_pool_bytes'] / mib:.0f} "
            f"| {(r['rss_after_runs'] - r['rss_before']) / (r['file_bytes'] + r['kv_pool_bytes']):.2f} "
            f"| {d1['step_ms']:.1f} ({d1['roofline_share']:.2f}) | {d16['step_ms']:.1f} ({d16['roofline_share']:.2f}) "
            f"| {r['prefill_tok_s']:.0f} | {r['serve']['req_s']:.2f} | {r['serve']['out_tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,qwen2-0.5b", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--quantizations", default="Q4_0,Q4_1,Q8_0,F16", help=f"of {', '.join(QUANTIZATIONS)}")
    ap.add_argument("--only", default=None, help="model:quant pairs to measure (default: every combination)")
    ap.add_argument("--no-default", action="store_true", help="skip the default model (SmolLM2 Q4_1)")
    ap.add_argument("--keep", default=None, help="write (or reuse) the files in this directory and keep them")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--serve", default="16,128,64", help="requests,prompt tokens,new tokens")
    ap.add_argument("--max-total-tokens", type=int, default=4096,
                    help="KV pool tokens (0: the default flags' pool, sized from the memory left after the weights)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an Engine keyword for every file (e.g. quantization=none: F16 widened to float32; "
                         "disable_cuda_graph=true); repeatable")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one file, JSON on stdout
    args = ap.parse_args()
    serve = tuple(int(x) for x in args.serve.split(","))
    engine_args = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        engine_args[key] = {"true": True, "false": False}.get(value.lower(), value)
    if args.measure:
        print("RESULT " + json.dumps(measure(args.measure, args.max_total_tokens, args.decode_steps, serve,
                                             engine_args)))
        return

    from radixserve.model_loader import default_model_path

    load_before = os.getloadavg()
    out_dir = args.keep or tempfile.mkdtemp(prefix="bench_scaling_", dir="/tmp")
    os.makedirs(out_dir, exist_ok=True)
    quants = [q for q in args.quantizations.split(",") if q]
    only = set(args.only.split(",")) if args.only else None
    files: list[tuple[str, str]] = [] if args.no_default else [("SmolLM2-135M Q4_1 (default)", default_model_path())]
    try:
        for m in [m for m in args.models.split(",") if m]:
            todo = [q for q in quants if only is None or f"{m}:{q}" in only]
            missing = [q for q in todo if not os.path.exists(os.path.join(out_dir, f"{m}.{q}.gguf"))]
            if missing:
                t = time.perf_counter()
                write_models(MODELS[m], missing, out_dir, m)
                print(f"wrote {m} {','.join(missing)} in {time.perf_counter() - t:.0f} s", flush=True)
            files += [(f"{m} {q}", os.path.join(out_dir, f"{m}.{q}.gguf")) for q in todo]
        rows = []
        for name, path in files:
            cmd = [sys.executable, os.path.abspath(__file__), "--measure", path, "--decode-steps",
                   str(args.decode_steps), "--serve", args.serve, "--max-total-tokens", str(args.max_total_tokens),
                   *[f"--engine-arg={a}" for a in args.engine_arg]]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not result:
                print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            row = json.loads(result[-1][len("RESULT "):])
            rows.append((name, row))
            print(f"{name}: done, load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(out_dir, ignore_errors=True)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "rows": dict(rows)}
    print("\n" + _table(rows))
    print(f"\nload average before {load_before}, after {report['machine']['loadavg_after']}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
