"""Where a stream of prompts spends its time, step by step: the stall-free default against
other scheduling flags, in one process.

    python benchmarks/bench_mixed_steps.py [--configs "old=--disable-mixed-chunk --chunked-prefill-size 2048" "new="]
        [--prompts 64] [--clients 16] [--min-len 40] [--max-len 440] [--new-tokens 32] [--rounds 2]
        [--breakdown CONFIG ...] [--profile CONFIG]

One ``Engine`` per configuration on the default model. ``--clients`` threads each take prompts
of random token ids (lengths uniform in [min-len, max-len], the same for every
configuration) off a shared list and generate ``--new-tokens`` greedy tokens with
``ignore_eos``, so ``--clients`` requests are in flight until the list runs out. Every forward
step is timed (``ModelRunner.forward``) and classified: plain decode, extend (prefill
chunks only) or mixed (prefill chunks with decode rows). The report gives the wall time,
the steps of each kind with their rows and total time, and a least-squares fit of step time
= ``a + per_row * decode rows + per_token * prompt tokens`` per kind of step.
Configurations alternate over ``--rounds``. ``--breakdown NAME ...`` also times each kind of
module (each linear, attention and its halves, norms, activation, rotary, LM head) inside the
named configurations' extend and mixed steps; ``--profile NAME`` records the named
configuration's mixed steps with ``torch.profiler`` (its per-step toggling inflates small ops)
and prints the top operators. The requests go to the engine's scheduler thread, as in a server.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import threading
import time

import torch


def parse_flags(text: str) -> dict:
    """``--a-b 3 --flag`` -> {"a_b": 3, "flag": True} (numbers as int/float)."""
    out, words = {}, shlex.split(text)
    i = 0
    while i < len(words):
        key = words[i].lstrip("-").replace("-", "_")
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            val = {"true": True, "false": False}.get(words[i + 1].lower(), words[i + 1])
            for conv in (int, float) if isinstance(val, str) else ():
                try:
                    val = conv(val)
                    break
                except ValueError:
                    pass
            out[key] = val
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def fit(rows: list[tuple[float, float, float]]) -> tuple[float, ...] | None:
    """Least squares of seconds = a + b * decode_rows + c * prompt_tokens over (rows, tokens, s)."""
    if len(rows) < 4:
        return None
    x = torch.tensor([[1.0, r, n] for r, n, _ in rows], dtype=torch.float64)
    y = torch.tensor([s for _, _, s in rows], dtype=torch.float64)
    sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    return tuple(float(v) for v in sol)


def run_config(model: str, flags: dict, prompts: list[list[int]], clients: int, new_tokens: int,
               profile: bool, breakdown: bool = False) -> dict:
    from radixserve import Engine

    flags = {"disable_radix_cache": True, **flags}
    engine = Engine(model=model, **flags)
    engine._ensure_loop()  # every generate below goes to the scheduler thread, as in a server
    runner = engine.runner
    parts: dict[tuple[str, str], float] = {}
    in_mixed = [""]  # the kind of the step running now
    if breakdown:
        _time_modules(runner, parts, in_mixed)
    steps: list[tuple[str, int, int, float]] = []  # kind, decode rows, prompt tokens, seconds
    inner = runner.forward
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)

    def timed(batch):
        if batch.is_decode:
            kind, dec, tok = "decode", batch.batch_size, 0
        elif batch.is_mixed:
            kind, dec = "mixed", batch.num_decode
            tok = sum(batch.extend_lens_cpu[:batch.num_extend])
        else:
            kind, dec, tok = "extend", 0, sum(batch.extend_lens_cpu)
        use_prof = prof is not None and kind == "mixed"
        in_mixed[0] = kind
        if use_prof:
            prof.__enter__()
        t = time.perf_counter()
        out = inner(batch)
        dt = time.perf_counter() - t
        if use_prof:
            prof.__exit__(None, None, None)
        steps.append((kind, dec, tok, dt))
        return out

    # warm up (kernel builds, tapes) outside the measurement
    engine.generate(input_ids=[prompts[0]] * 2, sampling_params={"max_new_tokens": 4, "temperature": 0.0,
                                                                 "ignore_eos": True})
    runner.forward = timed
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            engine.generate(input_ids=prompts[i], sampling_params={"max_new_tokens": new_tokens,
                                                                   "temperature": 0.0, "ignore_eos": True})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    runner.forward = inner
    engine.shutdown()
    res = {"wall": wall, "steps": steps}
    if breakdown:
        res["parts"] = parts
    if prof is not None:
        res["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return res


def _time_modules(runner, parts: dict[tuple[str, str], float], step_kind: list[str]) -> None:
    """Accumulate, per kind of step, the seconds each kind of module's forward takes
    (instance-level wrappers: linears by name, norms, activation, rotary, attention, LM head)."""
    def wrap(obj, attr, label):
        inner = getattr(obj, attr)

        def timed(*a, **k):
            if step_kind[0] == "decode":  # decode steps replay tapes: nothing to time
                return inner(*a, **k)
            t = time.perf_counter()
            out = inner(*a, **k)
            key = (step_kind[0], label)
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - t
            return out
        setattr(obj, attr, timed)

    for name, mod in runner.model.named_modules():
        kind = type(mod).__name__
        if kind in ("RMSNorm", "SiluAndMul", "QKVRotary", "VocabParallelEmbedding", "ParallelLMHead"):
            wrap(mod, "forward", kind)
        elif hasattr(mod, "quant_method") or kind.endswith("Linear"):
            wrap(mod, "forward", "linear:" + name.rsplit(".", 1)[-1])
    wrap(runner.attn_backend, "forward", "attention")
    for attr in ("_extend", "_decode"):  # the torch_native backend's halves of a mixed step
        if hasattr(runner.attn_backend, attr):
            wrap(runner.attn_backend, attr, "attention" + attr)
    wrap(runner.kv_pool, "set_kv", "attention: set_kv")
    wrap(runner.attn_backend, "init_forward_metadata", "attention metadata")
    wrap(runner.model, "forward", "model forward (all)")


def report(name: str, res: dict) -> None:
    steps = res["steps"]
    print(f"\n== {name}: wall {res['wall']:.2f} s, {len(steps)} forwards, "
          f"forward time {sum(s[3] for s in steps):.2f} s")
    for kind in ("decode", "extend", "mixed"):
        sel = [s for s in steps if s[0] == kind]
        if not sel:
            continue
        total = sum(s[3] for s in sel)
        rows = statistics.mean(s[1] for s in sel)
        toks = statistics.mean(s[2] for s in sel)
        med = statistics.median(s[3] for s in sel) * 1e3
        line = (f"  {kind:6s} {len(sel):4d} steps {total:7.2f} s  median {med:7.1f} ms  "
                f"mean decode rows {rows:5.1f}  mean prompt tokens {toks:6.1f}")
        f = fit([(s[1], s[2], s[3]) for s in sel])
        if f is not None and kind != "decode":
            line += f"  fit: {f[0] * 1e3:.1f} ms + {f[1] * 1e3:.2f} ms/row + {f[2] * 1e3:.3f} ms/token"
        elif kind == "decode" and len(sel) >= 4:
            x = torch.tensor([[1.0, s[1]] for s in sel], dtype=torch.float64)
            y = torch.tensor([[s[3]] for s in sel], dtype=torch.float64)
            a, b = torch.linalg.lstsq(x, y).solution[:, 0].tolist()
            line += f"  fit: {a * 1e3:.1f} ms + {b * 1e3:.2f} ms/row"
        print(line)
    if "parts" in res:
        for kind in ("extend", "mixed"):
            sel = [s for s in steps if s[0] == kind]
            tokens = sum(s[2] + s[1] for s in sel) or 1
            items = sorted(((lab, sec) for (k, lab), sec in res["parts"].items() if k == kind), key=lambda kv: -kv[1])
            for label, sec in items:
                print(f"    {kind:6s} {label:28s} {sec * 1e3 / max(len(sel), 1):8.2f} ms per step, "
                      f"{sec * 1e6 / tokens:7.1f} us per row, {sec:6.2f} s in all")
    if "profile" in res:
        print(res["profile"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", nargs="+", default=["old=--disable-mixed-chunk --chunked-prefill-size 2048", "new="])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=440)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--breakdown", default=None, nargs="*",
                    help="time each kind of module in these configurations' extend and mixed steps")
    ap.add_argument("--profile", default=None, help="record this configuration's mixed steps with torch.profiler")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from radixserve.model_loader.loader import default_model_path
        model = default_model_path()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (int(n),), generator=gen).tolist()
               for n in torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=gen)]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new each, "
          f"{args.clients} clients")
    walls: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for spec in args.configs:
            name, _, text = spec.partition("=")
            res = run_config(model, parse_flags(text), prompts, args.clients, args.new_tokens,
                             profile=args.profile == name and rnd == 0, breakdown=name in (args.breakdown or ()))
            walls.setdefault(name, []).append(res["wall"])
            report(f"{name} (round {rnd + 1})", res)
    print("\nwall seconds per configuration:", {k: [round(w, 2) for w in v] for k, v in walls.items()})


if __name__ == "__main__":
    main()
