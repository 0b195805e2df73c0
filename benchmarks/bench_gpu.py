"""The GPU numbers scripts/gpu_check.sh prints (issue 17), also runnable on CPU at toy sizes.

``attention``: each attention backend available here (``radixserve plugins``: torch_native,
triton, flashinfer, fa3, fa2, ...) times one layer's prefill (extend over a cached prefix)
and decode over a paged KV pool, next to torch's scaled_dot_product_attention over the same
K/V laid out dense (no paging: a floor, not a competitor). Median of timed repeats, CUDA
events on a GPU.

``decode``: the default model's decode throughput per attention backend with and without
CUDA graphs (``--disable-cuda-graph``), at a few batch sizes, end to end through
``Engine.generate`` (short prompts, ``ignore_eos``), and whether the graphs gave the eager
run's greedy tokens.

``moe`` / ``a2a``: MoE runners against torch_native, DeepEP against torch_distributed
(:mod:`bench_gpu_moe`). ``warm``: runs each available GPU attention backend once at the shapes
the other sections use, and each MoE runner, so kernels built on first use (FlashInfer's and
DeepGEMM's JIT, Triton's) are compiled before anything is timed; prints how long that took.

    python benchmarks/bench_gpu.py attention [--quick] [--json OUT.json]
    python benchmarks/bench_gpu.py decode [--backends triton,flashinfer] [--batch-sizes 1,16]
    python benchmarks/bench_gpu.py moe [--batch-sizes 1,32,128,512,2048]
    python benchmarks/bench_gpu.py a2a [--tokens 64,4096]
    python benchmarks/bench_gpu.py warm --model MODEL

Every section prints a markdown table; ``--json`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _timer(device: torch.device):
    """``fn -> seconds`` of one call: CUDA events on a GPU, the wall clock on CPU."""
    if device.type == "cuda":
        def one(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def one(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return one


def median_ms(fn, device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    one = _timer(device)
    for _ in range(warmup):
        fn()
    return 1e3 * statistics.median(one(fn) for _ in range(repeats))


# ------------------------------------------------------------------ attention
def attention_shapes(quick: bool, dtype: torch.dtype):
    """(label, Case) pairs: GQA 32/8 heads of 128 (a Llama-8B layer), pages of 16."""
    from radixserve.testing.attention_conformance import Case

    if quick:  # CPU smoke sizes
        return [("decode b4 ctx64", Case("decode", 16, 4, 2, 64, (63,) * 4, (1,) * 4, dtype=dtype)),
                ("prefill b2 pre32 ext32", Case("extend", 16, 4, 2, 64, (32,) * 2, (32,) * 2, dtype=dtype))]
    return [
        ("decode b1 ctx4096", Case("decode", 16, 32, 8, 128, (4095,), (1,), dtype=dtype)),
        ("decode b32 ctx1024", Case("decode", 16, 32, 8, 128, (1023,) * 32, (1,) * 32, dtype=dtype)),
        ("decode b64 ctx2048", Case("decode", 16, 32, 8, 128, (2047,) * 64, (1,) * 64, dtype=dtype)),
        ("prefill b4 pre0 ext1024", Case("extend", 16, 32, 8, 128, (0,) * 4, (1024,) * 4, dtype=dtype)),
        ("prefill b4 pre2048 ext256", Case("extend", 16, 32, 8, 128, (2048,) * 4, (256,) * 4, dtype=dtype)),
    ]


def sdpa_ms(built, device: torch.device) -> float:
    """SDPA over dense K/V of the same requests (equal lengths: one batched call)."""
    case = built.case
    n, e = len(case.prefix_lens), case.extend_lens[0]
    total = case.prefix_lens[0] + e
    dt = case.dtype
    q = built.q.view(n, e, case.num_heads, case.head_dim).transpose(1, 2)  # [B, H, E, D]
    k = torch.stack(built.all_k).to(device=device, dtype=dt).transpose(1, 2)  # [B, Hkv, L, D]
    v = torch.stack(built.all_v).to(device=device, dtype=dt).transpose(1, 2)
    # new token i sees positions <= prefix + i (bottom-right causal)
    mask = None
    if e > 1:
        mask = torch.ones(e, total, dtype=torch.bool, device=device).tril(total - e)
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), device)


def bench_attention(device: torch.device, quick: bool, backends: list[str] | None) -> list[dict]:
    from radixserve.registry import get_registry
    from radixserve.testing.attention_conformance import build_case

    registry = get_registry()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    entries = registry.entries["attention"]
    names = backends or sorted(entries)
    rows = []
    for label, case in attention_shapes(quick, dtype):
        built = build_case(case, device=str(device), seed=0)
        base = sdpa_ms(built, device)
        for name in names:
            entry = entries.get(name)
            why = "not installed" if entry is None else entry.unavailable_reason()
            row = {"shape": label, "backend": name, "sdpa_ms": base}
            if why is not None:
                rows.append({**row, "ms": None, "note": why})
                continue
            try:
                backend = entry.factory(built.ctx)
                built.batch.attn_metadata = None
                backend.init_forward_metadata(built.batch)
                ms = median_ms(lambda b=backend, c=built: b.forward(c.q, c.k_new, c.v_new, c.layer, c.batch),
                               device)
                rows.append({**row, "ms": ms, "note": ""})
            except Exception as e:  # noqa: BLE001 - one backend's failure is a row, not the end
                rows.append({**row, "ms": None, "note": f"{type(e).__name__}: {e}"[:160]})
        del built
    return rows


def attention_table(rows: list[dict]) -> str:
    out = ["| shape | backend | ms | SDPA dense ms | x SDPA | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        ratio = "-" if r["ms"] is None else f"{r['ms'] / r['sdpa_ms']:.2f}"
        out.append(f"| {r['shape']} | {r['backend']} | {ms} | {r['sdpa_ms']:.3f} | {ratio} | {r['note']} |")
    return "\n".join(out)


# ---------------------------------------------------------------------- model
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                     rope_theta=100000.0)


def model_path(out_dir: str) -> str:
    """The default model when it is installed; else (a GPU machine the 98 MB GGUF cannot be
    carried to) a random-weight checkpoint of its exact shape (SmolLM2-135M: 30 layers, 9/3
    heads of 64, vocabulary 49152, tied embeddings) with a word-level tokenizer, built in
    ``out_dir``: the same work per token, other tokens."""
    import os
    import sys

    from radixserve.model_loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pass
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from tiny_models import build_checkpoint

        build_checkpoint(out_dir, "llama_tied", seed=0, **SMOLLM2_SHAPE)
    return out_dir


def token_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts as token ids that every tokenizer here knows (ids 3..299: the word-level
    tokenizer of the random checkpoint has exactly those)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n, length), generator=g).tolist()


def parity(model: str, new_tokens: int = 24) -> dict:
    """float32 on CPU vs on CUDA, torch_native attention both: greedy tokens of three
    prompts and the largest logit difference over one prompt."""
    import radixserve

    prompts = token_prompts(3, 24, seed=1)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    out, logits = {}, {}
    for device in ("cpu", "cuda"):
        with radixserve.Engine(model, device=device, dtype="float32", attention_backend="torch_native",
                               quantization="none", max_total_tokens=4096, disable_cuda_graph=True) as engine:
            out[device] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            logits[device] = engine.runner.prompt_logits(prompts[0]).float().cpu()
    same = sum(a == b for a, b in zip(out["cpu"], out["cuda"]))
    diff = (logits["cpu"] - logits["cuda"]).abs().max().item()
    scale = logits["cpu"].abs().max().item()
    return {"same_greedy": same, "prompts": len(prompts), "max_logit_diff": diff, "max_logit": scale}


# --------------------------------------------------------------------- decode
def bench_decode(device: str, backends: list[str], batch_sizes: list[int], new_tokens: int, dtype: str,
                 model: str | None) -> list[dict]:
    import radixserve
    from radixserve.registry import get_registry

    entries = get_registry().entries["attention"]
    prompts = token_prompts(max(batch_sizes), 32)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    rows = []
    for name in backends:
        entry = entries.get(name)
        why = "not installed" if entry is None else entry.unavailable_reason()
        if why is not None:
            rows.append({"backend": name, "note": why})
            continue
        tokens: dict[tuple[bool, int], list] = {}
        for graphs in (False, True):
            row = {"backend": name, "cuda_graph": graphs, "note": ""}
            try:
                with radixserve.Engine(model, device=device, dtype=dtype, attention_backend=name,
                                       max_running_requests=max(batch_sizes), disable_cuda_graph=not graphs,
                                       cuda_graph_bs=batch_sizes, disable_radix_cache=True) as engine:
                    row["captured"] = engine.runner.graph_runner is not None
                    for bs in batch_sizes:
                        engine.generate(input_ids=prompts[:bs], sampling_params={**params, "max_new_tokens": 4})
                        t0 = time.perf_counter()
                        outs = engine.generate(input_ids=prompts[:bs], sampling_params=params)
                        seconds = time.perf_counter() - t0
                        tokens[(graphs, bs)] = [o["output_ids"] for o in outs]
                        row[f"bs{bs}"] = bs * new_tokens / seconds
                    row["replays"] = engine.get_stats().get("cuda_graph_replays", 0)
            except Exception as e:  # noqa: BLE001
                row["note"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
        same = [tokens.get((True, bs)) == tokens.get((False, bs)) for bs in batch_sizes
                if (True, bs) in tokens and (False, bs) in tokens]
        if same:
            rows[-1]["same_tokens"] = all(same)
    return rows


def decode_table(rows: list[dict], batch_sizes: list[int]) -> str:
    head = " | ".join(f"tok/s bs{bs}" for bs in batch_sizes)
    out = [f"| backend | CUDA graphs | {head} | graphs replayed | same tokens as eager | note |",
           "|---|---|" + "---|" * len(batch_sizes) + "---|---|---|"]
    for r in rows:
        vals = " | ".join(f"{r[f'bs{bs}']:.0f}" if f"bs{bs}" in r else "-" for bs in batch_sizes)
        graphs = {True: "on" if r.get("captured") else "on (none captured)", False: "off"}.get(r.get("cuda_graph"), "-")
        same = {True: "yes", False: "**no**"}.get(r.get("same_tokens"), "")
        out.append(f"| {r['backend']} | {graphs} | {vals} | {r.get('replays', '-')} | {same} | {r['note']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--quick", action="store_true", help="toy shapes (a CPU smoke run)")
    a.add_argument("--backends", default=None, help="comma-separated (default: every registered one)")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--json", default=None)
    d = sub.add_parser("decode")
    d.add_argument("--backends", default="torch_native,triton,flashinfer,fa3,fa2")
    d.add_argument("--batch-sizes", default="1,16")
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--dtype", default="bfloat16")
    d.add_argument("--device", default="cuda")
    d.add_argument("--model", default=None)
    d.add_argument("--json", default=None)
    m = sub.add_parser("model", help="print the model path to use (building the random stand-in if needed)")
    m.add_argument("--out", required=True)
    mo = sub.add_parser("moe", help="MoE runners against torch_native (bf16, one layer)")
    mo.add_argument("--batch-sizes", default="1,32,128,512,2048")
    mo.add_argument("--json", default=None)
    aa = sub.add_parser("a2a", help="DeepEP dispatch + combine against torch_distributed")
    aa.add_argument("--tokens", default="64,4096")
    aa.add_argument("--json", default=None)
    w = sub.add_parser("warm", help="compile the GPU backends' kernels the other sections use, once")
    w.add_argument("--model", default=None)
    w.add_argument("--backends", default="flashinfer,fa3,fa2,triton")
    p = sub.add_parser("parity", help="float32 CPU vs CUDA: greedy tokens and logits")
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.what == "model":
        print(model_path(args.out))
        return
    if args.what == "parity":
        rows = parity(args.model)
        r = rows
        ok = r["same_greedy"] == r["prompts"] and r["max_logit_diff"] <= 1e-3 * max(1.0, r["max_logit"])
        print(f"greedy float32, cpu vs cuda: {r['same_greedy']}/{r['prompts']} identical; max |logit diff| "
              f"{r['max_logit_diff']:.2e} (max |logit| {r['max_logit']:.1f}) -> {'pass' if ok else 'FAIL'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        raise SystemExit(0 if ok else 1)
    if args.what in ("moe", "a2a", "warm"):
        other_sections(args)
        return
    if args.what == "attention":
        rows = bench_attention(torch.device(args.device), args.quick,
                               args.backends.split(",") if args.backends else None)
        print(attention_table(rows))
    else:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        rows = bench_decode(args.device, args.backends.split(","), sizes, args.new_tokens, args.dtype, args.model)
        print(decode_table(rows, sizes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def warm(backends: list[str], model: str | None) -> None:
    """One untimed pass of each available backend over the attention section's shapes and one
    short decode of the model, so first-use compiles happen here; the seconds each took."""
    from radixserve.registry import get_registry

    entries = get_registry().entries["attention"]
    for name in backends:
        entry = entries.get(name)
        reason = "not installed" if entry is None else entry.unavailable_reason()
        if reason is not None:
            print(f"warm {name}: skipped ({reason})")
            continue
        t0 = time.perf_counter()
        bench_attention(torch.device("cuda"), False, [name])
        bench_decode("cuda", [name], [1], 2, "bfloat16", model)
        print(f"warm {name}: {time.perf_counter() - t0:.1f} s (kernels compiled on first use included)")
    from bench_gpu_moe import bench_moe  # MoE runners (Triton's and DeepGEMM's kernels compile on first use too)

    t0 = time.perf_counter()
    bench_moe([1, 256])
    print(f"warm moe runners: {time.perf_counter() - t0:.1f} s")


def other_sections(args) -> None:
    from bench_gpu_moe import a2a_table, bench_a2a, bench_moe, moe_table

    rows: list = []
    if not torch.cuda.is_available():
        print(f"{args.what}: skipped (torch sees no CUDA device)")
        return
    if args.what == "warm":
        warm(args.backends.split(","), args.model)
        return
    if args.what == "moe":
        rows = bench_moe([int(b) for b in args.batch_sizes.split(",")])
        print(moe_table(rows))
    else:
        rows, reason = bench_a2a([int(n) for n in args.tokens.split(",")])
        print(a2a_table(rows) if reason is None else f"a2a: skipped ({reason})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
