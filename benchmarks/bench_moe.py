"""MoE speed: radixserve's MoE runners against transformers on the same random weights,
measured in one run on this machine.

A random Qwen3-MoE-shaped model (default: 8 layers, hidden 1024, 48 experts of
intermediate 384, top-8, 16 query / 4 KV heads of 64, vocabulary 32000, ~0.53 B
parameters) is built from a transformers ``Qwen3MoeConfig``, saved as safetensors (with a
word-level tokenizer) in a temporary directory, and run by

* **layer**: one sparse MoE block alone (router + experts) at batch 1, 32 and the prefill
  length: each runner through the core's routing (``select_experts``) and the runner's
  ``forward`` against transformers' ``Qwen3MoeSparseMoeBlock`` of layer 0 (and
  ``torch_native/plain``: torch_native with radixserve's CPU kernels off);
* **model**: the whole model: radixserve's engine with ``--moe-runner-backend <runner>``
  against transformers' ``generate``: prefill tok/s (one prompt of ``--prompt-len``) and
  decode tok/s at batch 1 and 32. Decode tok/s is (time to generate N+1 tokens - time to
  generate 1) / N per sequence, the same subtraction for both, so prefill and start-up
  cancel. Every sequence of a batch has its own random prompt (identical prompts would
  route identically and touch only top-k experts per layer).

Every number is the best of ``--repeats`` runs (noise on a shared machine only slows a run
down). transformers runs in float32 with its default experts implementation for the model
(``config._experts_implementation`` after loading, recorded in the results).

Runners: every installed MoE runner usable here; on CPU that is ``torch_native`` (the
Triton runner needs a GPU; under ``TRITON_INTERPRET=1`` it is a test tool and is skipped).
With ``--device cuda`` both engines run on the GPU in ``--dtype`` (default bfloat16 there).

    python benchmarks/bench_moe.py            # about 10 minutes on 2 cores
    python benchmarks/bench_moe.py --quick    # 2 layers, short runs: a smoke test

Results are appended as JSON lines to ``benchmarks/results/moe.jsonl``, one line per
(level, runner, measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch
from bench_offline import measure_bandwidth  # noqa: E402  (same directory: run as a script)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe.jsonl")


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------ the model
def make_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations, and router logits spread enough that routing is not uniform noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):  # router [E, H]
                p.copy_(2.0 * noise / p.shape[-1] ** 0.5)
            else:  # [out, in], or [E, out, in] for the stacked experts
                p.copy_(noise / p.shape[-1] ** 0.5)


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over ``<unk> <s> </s> t3 ..``: the engine loads one, the
    benchmark only ever passes token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def build_model(args, path: str):
    """The transformers model (float32, eval) saved to ``path``; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(make_config(args), dtype=torch.float32)
    randomize(model, args.seed)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, args.vocab)
    return model.eval()


def expert_bytes_per_step(args, batch: int, num_layers: int) -> tuple[float, float]:
    """(bytes of expert weights a decode step reads, expected distinct experts per layer)
    for ``batch`` tokens routed to ``top_k`` of ``experts`` uniformly at random."""
    e, k = args.experts, args.top_k
    distinct = e * (1 - (1 - k / e) ** batch)
    per_expert = 3 * args.hidden * args.moe_intermediate * 4
    return distinct * per_expert * num_layers, distinct


# ------------------------------------------------------------------ runners
def installed_runners(device: str) -> tuple[list[str], dict[str, str]]:
    """(runners usable here, {runner: why it is skipped})."""
    from radixserve.registry import get_registry

    usable, skipped = [], {}
    for name, entry in sorted(get_registry().entries["moe_runner"].items()):
        reason = entry.unavailable_reason()
        if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            reason = "TRITON_INTERPRET=1 (the interpreter is a test tool, not a runner to time)"
        elif name == "triton" and device != "cuda":
            reason = reason or "needs a GPU"
        if reason is None:
            usable.append(name)
        else:
            skipped[name] = reason
    return usable, skipped


# ------------------------------------------------------------------ layer level
def bench_layer(args, hf, runners, device, dtype, batches) -> list[dict]:
    from radixserve.layers.moe import ExpertWeights, MoEContext, select_experts
    from radixserve.registry import get_registry

    block = hf.model.layers[0].mlp.to(device)
    experts = block.experts
    ctx = MoEContext(num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
                     intermediate_size=args.moe_intermediate, dtype=dtype, device=torch.device(device))
    gate = block.gate.weight.detach()
    rows = []
    g = torch.Generator().manual_seed(1)
    # A few different inputs per batch size, used in turn: the same input every call would
    # route to the same experts and time their weights in cache (48 experts: 226 MB).
    inputs = {b: [torch.randn(b, args.hidden, generator=g).to(device=device, dtype=dtype) for _ in range(4)]
              for b in batches}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def cycling(fn, xs):
        it = iter(range(10**9))

        def run():
            fn(xs[next(it) % len(xs)])
            sync()
        return run

    with torch.inference_mode():
        hf_ms, refs = {}, {}
        for b, xs in inputs.items():
            refs[b] = block(xs[0][None])[0]
            hf_ms[b] = best_of(cycling(lambda x: block(x[None]), xs), args.layer_repeats) * 1000
        variants = [(name, get_registry().get("moe_runner", name).factory) for name in runners]
        if "torch_native" in runners:  # what radixserve's CPU kernels add: the same runner without them
            from radixserve_moe_torch import make_runner
            variants.append(("torch_native/plain", lambda c: make_runner(c, use_kernels=False)))
        for name, factory in variants:
            runner = factory(ctx)
            state = runner.prepare(ExpertWeights(experts.gate_up_proj.detach().contiguous(),
                                                 experts.down_proj.detach().contiguous()))

            def layer(x, runner=runner, state=state):
                ids, weights = select_experts(torch.nn.functional.linear(x, gate), args.top_k, True)
                return runner.forward(x, ids, weights, state)

            for b, xs in inputs.items():
                err = float((layer(xs[0]) - refs[b]).abs().max())
                ms = best_of(cycling(layer, xs), args.layer_repeats) * 1000
                rows.append({"level": "layer", "runner": name, "batch": b, "ms": round(ms, 3),
                             "transformers_ms": round(hf_ms[b], 3), "speedup": round(hf_ms[b] / ms, 2),
                             "max_abs_diff_vs_transformers": err})
                print(f"layer  {name:12s} batch {b:4d}: {ms:8.2f} ms  transformers {hf_ms[b]:8.2f} ms  "
                      f"x{hf_ms[b] / ms:.2f}  (max |diff| {err:.1e})", flush=True)
    block.to("cpu")
    return rows


# ------------------------------------------------------------------ model level
def measure(gen, prefill_ids, decode_prompts, batches, steps, repeats) -> dict:
    """``gen(prompts, n)`` returns a callable that generates ``n`` tokens for each prompt."""
    res = {"prefill_tok_s": len(prefill_ids) / best_of(gen([prefill_ids], 1), repeats)}
    for b in batches:
        prompts = decode_prompts[:b]
        t_full = best_of(gen(prompts, steps + 1), repeats)
        t_first = best_of(gen(prompts, 1), repeats)
        res[f"decode_bs{b}_tok_s"] = b * steps / (t_full - t_first)
    return res


def bench_radixserve(path, runner, device, dtype, prefill_ids, decode_prompts, batches, steps, repeats) -> dict:
    from radixserve import Engine

    tokens = max(batches) * (len(decode_prompts[0]) + steps + 8) + len(prefill_ids) + 64
    engine = Engine(model=path, moe_runner_backend=runner, dtype=str(dtype).removeprefix("torch."), device=device,
                    disable_radix_cache=True, max_total_tokens=tokens)
    try:
        def gen(prompts, n):
            return lambda: engine.generate(input_ids=prompts, sampling_params={
                "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
        return measure(gen, prefill_ids, decode_prompts, batches, steps, repeats)
    finally:
        engine.shutdown()


def bench_transformers(hf, device, prefill_ids, decode_prompts, batches, steps, repeats) -> dict:
    hf.to(device)

    def gen(prompts, n):
        x = torch.tensor(prompts, device=device)
        mask = torch.ones_like(x)

        def run():
            hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
        return run

    with torch.inference_mode():
        res = measure(gen, prefill_ids, decode_prompts, batches, steps, repeats)
    hf.to("cpu")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, short prompts, one repeat: a smoke test")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for the prefill measurement")
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer-repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--runners", default=None, help="comma-separated (default: every runner usable here)")
    ap.add_argument("--skip-model", action="store_true", help="the layer-level measurement only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=RESULTS, help="JSON lines are appended here ('' for none)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.prompt_len, args.decode_steps = 2, 128, 8
        args.repeats, args.layer_repeats = 1, 3
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    batches = [int(b) for b in args.batch_sizes.split(",")]

    runners, skipped = installed_runners(args.device)
    if args.runners:
        wanted = args.runners.split(",")
        for name in wanted:
            if name not in runners:
                raise SystemExit(f"runner {name!r} is not usable here: {skipped.get(name, 'not installed')}")
        runners = wanted
    for name, why in skipped.items():
        print(f"skipping runner {name}: {why}", flush=True)

    load_before = os.getloadavg()
    bw = measure_bandwidth() if args.device == "cpu" else None
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as path:
        hf = build_model(args, path)
        hf.to(dtype)
        num_params = sum(p.numel() for p in hf.parameters())
        impl = hf.config._experts_implementation
        print(f"model: {num_params / 1e9:.3f} B parameters, transformers experts implementation {impl!r}, "
              f"load {load_before}", flush=True)
        common = {
            "time": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick,
            "machine": {"cpu": cpu_model(), "arch": platform.machine(), "cpu_count": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                        "device": args.device},
            "model": {"layers": args.layers, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                      "moe_intermediate": args.moe_intermediate, "vocab": args.vocab,
                      "params_B": round(num_params / 1e9, 3), "dtype": str(dtype).removeprefix("torch.")},
            "transformers_experts_implementation": impl,
            "bandwidth_GB_s": None if bw is None else round(bw / 1e9, 1),
        }
        rows = bench_layer(args, hf, runners, args.device, dtype, [*batches, args.prompt_len])
        if not args.skip_model:
            gen = torch.Generator().manual_seed(2)
            prefill_ids = torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist()
            decode_prompts = torch.randint(3, args.vocab, (max(batches), args.decode_prompt_len),
                                           generator=gen).tolist()
            theirs = bench_transformers(hf, args.device, prefill_ids, decode_prompts, batches, args.decode_steps,
                                        args.repeats)
            print(f"model  transformers: {json.dumps({k: round(v, 1) for k, v in theirs.items()})}", flush=True)
            for name in runners:
                ours = bench_radixserve(path, name, args.device, dtype, prefill_ids, decode_prompts, batches,
                                        args.decode_steps, args.repeats)
                for key, value in ours.items():
                    row = {"level": "model", "runner": name, "measure": key, "tok_s": round(value, 2),
                           "transformers_tok_s": round(theirs[key], 2), "speedup": round(value / theirs[key], 2)}
                    if bw is not None and key.startswith("decode_bs"):
                        b = int(key.removeprefix("decode_bs").removesuffix("_tok_s"))
                        expert_bytes, distinct = expert_bytes_per_step(args, b, args.layers)
                        other = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                                    if ".experts." not in n and "embed_tokens" not in n)
                        bound = bw / (expert_bytes + other) * b
                        row.update({"experts_read_per_layer": round(distinct, 1),
                                    "MB_read_per_step": round((expert_bytes + other) / 1e6, 1),
                                    "bandwidth_bound_tok_s": round(bound, 1),
                                    "fraction_of_bound": round(value / bound, 2)})
                    rows.append(row)
                    print(f"model  {name:12s} {key:18s}: {value:8.1f} tok/s  transformers {theirs[key]:8.1f}  "
                          f"x{value / theirs[key]:.2f}", flush=True)
    common["loadavg_1_5_15min"] = {"before": load_before, "after": os.getloadavg()}
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "a") as fh:
            for row in rows:
                fh.write(json.dumps({**common, **row}) + "\n")
        print(f"appended {len(rows)} lines to {args.output}")


if __name__ == "__main__":
    main()
