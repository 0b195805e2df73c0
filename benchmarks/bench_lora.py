"""Multi-LoRA decode throughput: a batch of ``--batch`` requests over ``--adapters`` distinct
adapters against the same batch with none, and against serving each adapter merged in turn.

On the default model (or ``--model``), random PEFT adapters of rank ``--rank`` on every linear
layer (q/k/v/o/gate/up/down) are written to a temporary directory. Rows:

* **base**: the engine without ``--enable-lora``, the whole batch at once (and again with
  ``--disable-cuda-graph``: decode steps run eagerly, without the CPU's kernel tapes);
* **adapters**: ``--lora-paths`` with the adapters, the batch split evenly over them (one batch,
  rows grouped per adapter by the LoRA backend; decode steps replay kernel tapes that hold the
  LoRA kernel's calls), and again eagerly;
* **merged, in turn**: what serving each adapter as its own merged model costs, one adapter's
  requests after another: a merged model multiplies like the base one, so this runs the base
  engine on each adapter's share of the batch in turn.

Each row: prompts of ``--input-len`` random tokens, ``--output-len`` greedy tokens (ignore EOS);
output tokens per second over the whole generate call (prefill included), and the decode rate
alone: (output - 1) tokens per request over the time a generate of ``--output-len`` tokens takes
beyond one of a single token (the same prefill, the prefix cache flushed before each); best of
``--repeat``.

    python benchmarks/bench_lora.py [--batch 16] [--adapters 4] [--rank 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import radixserve
import torch

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, cfg, rank: int, seed: int) -> None:
    """A PEFT-layout adapter with random weights over every linear layer of ``cfg``'s model."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (out, k) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as fh:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none"}, fh)


def seconds(engine, prompts, lora, new: int, repeat: int) -> float:
    """Best wall time of one generate of ``new`` tokens per prompt (prefix cache flushed first)."""
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    best = float("inf")
    for _ in range(repeat):
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params, lora_path=lora)
        best = min(best, time.perf_counter() - t0)
    return best


def rates(engine, prompts, lora, new: int, repeat: int) -> tuple[float, float]:
    """(output tokens/s of the whole generate, decode tokens/s beyond the first token)."""
    whole = seconds(engine, prompts, lora, new, repeat)
    first = seconds(engine, prompts, lora, 1, repeat)
    return len(prompts) * new / whole, len(prompts) * (new - 1) / max(whole - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.batch)]
    names = [f"lora{i}" for i in range(args.adapters)]
    lora = [names[i % args.adapters] for i in range(args.batch)]
    kw = dict(max_total_tokens=16384) | ({"model_path": args.model} if args.model else {})
    with tempfile.TemporaryDirectory() as tmp:
        with radixserve.Engine(**kw) as engine:
            cfg = engine.model_config
            base = rates(engine, prompts, None, args.output_len, args.repeat)
            shares = [[p for p, n in zip(prompts, lora) if n == name] for name in names]
            whole = sum(seconds(engine, s, None, args.output_len, args.repeat) for s in shares)  # one after another
            first = sum(seconds(engine, s, None, 1, args.repeat) for s in shares)
            merged = (args.batch * args.output_len / whole, args.batch * (args.output_len - 1) / (whole - first))
        with radixserve.Engine(disable_cuda_graph=True, **kw) as engine:
            eager = rates(engine, prompts, None, args.output_len, args.repeat)
        paths = []
        for i, name in enumerate(names):
            path = os.path.join(tmp, name)
            write_adapter(path, cfg, args.rank, seed=i)
            paths.append(f"{name}={path}")
        with radixserve.Engine(lora_paths=paths, max_loras_per_batch=max(args.adapters, 1), **kw) as engine:
            multi = rates(engine, prompts, lora, args.output_len, args.repeat)
            single = rates(engine, prompts, names[0], args.output_len, args.repeat)
        with radixserve.Engine(lora_paths=paths, max_loras_per_batch=max(args.adapters, 1), disable_cuda_graph=True,
                               **kw) as engine:
            multi_eager = rates(engine, prompts, lora, args.output_len, args.repeat)
    print(f"{cfg.architecture}, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on 7 modules, "
          f"{args.input_len} prompt + {args.output_len} output tokens, {torch.get_num_threads()} threads")
    print("| setup | output tok/s | vs base | decode tok/s | vs base |")
    print("|---|---|---|---|---|")
    for label, (whole, decode) in (("base (no adapters)", base), ("base, eager (--disable-cuda-graph)", eager),
                                   (f"{args.adapters} adapters in one batch", multi),
                                   (f"{args.adapters} adapters, eager (--disable-cuda-graph)", multi_eager),
                                   ("one adapter for the whole batch", single),
                                   ("each adapter merged, in turn", merged)):
        print(f"| {label} | {whole:.1f} | {whole / base[0]:.2f}x | {decode:.1f} | {decode / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
