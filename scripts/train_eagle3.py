#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a radixserve target model on CPU, in minutes.

1. Data: chat prompts answered by the target itself through radixserve's Engine, greedily
   (greedy answers make the target's own argmax the next token at every answer position).
   Most prompts are written by the target too: sampled from the chat template cut right
   after the user turn opens (the "Magpie" recipe), so they cover what users of this model
   ask far more broadly than any fixed list; the rest come from topic x template lists.
2. Features: one extend pass of the target over every prompt + answer, keeping the
   hidden states after the aux layers (default ``[1, L//2 - 1, L - 4]``) and after the
   last layer (for the target's distribution over the draft vocabulary).
3. Draft vocabulary: the ``--draft-vocab-size`` most frequent answer tokens, sorted;
   ``d2t``/``t2d`` as SGLang and SpecForge read them.
4. Training: row ``i`` = target hidden of token ``i`` + embedding of token ``i + 1`` at
   position ``i``, predicting token ``i + 2``; ``--ttt-steps`` unrolled steps (step ``k``
   feeds the previous step's output, embeds token ``i + k + 1`` at position ``i + k``,
   attends causally to step 0's keys and to its own keys of steps 1..k), losses weighted
   ``0.8 ** k``; soft cross-entropy against the target's distribution renormalised over
   the draft vocabulary (``--loss hard``: the next token).
5. Output: ``config.json`` + ``model.safetensors`` in the SGLang/SpecForge
   ``LlamaForCausalLMEagle3`` layout (no embedding: the target's is used), ready for
   ``--speculative-algorithm eagle3 --speculative-draft-model-path OUT``.

Prints the held-out top-1 accuracy of every draft step (step 1 is what the first draft
token's acceptance rate approaches).

    python scripts/train_eagle3.py --out /tmp/eagle3-smollm2   # ~48-90 min on 2 cores

(on a 2-core EPYC with AVX512-BF16: the target writes 1,536 prompts in 7 min and answers
2,048 in 16 min, hidden-state capture 13 min, 6 bf16 epochs 12 min; held-out first-step
top-1 0.51. On an AVX2-only EPYC the epochs run in fp32, ~6.7 min each, ~90 min in all;
top-1 0.51 again.
``--self-prompts 0 --num-prompts 768 --epochs 10 --draft-vocab-size 2048`` trains the
earlier ~8-minute head, top-1 0.50 on its own narrow prompts but 0.35 on other chat.)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from collections import Counter

import torch
import torch.nn.functional as F

TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "machine learning", "the water cycle",
    "volcanoes", "the Roman Empire", "climate change", "the human heart", "electric cars", "honey bees",
    "the stock market", "jazz music", "the Moon landing", "vaccines", "recycling", "the Great Wall of China",
    "coffee", "earthquakes", "the internet", "dinosaurs", "solar panels", "chess", "the Amazon rainforest",
    "sleep", "the printing press", "penguins", "Python programming", "the immune system", "rainbows",
    "ancient Egypt", "gravity", "time management", "healthy breakfasts", "the Olympic Games", "bread baking",
    "the ocean tides", "Shakespeare", "bicycles", "friendship", "the periodic table", "renewable energy",
    "the Renaissance", "public speaking", "volunteering", "the solar system", "memory", "gardening",
    "the Industrial Revolution", "whales", "mountains", "democracy", "music theory", "first aid", "tea",
    "the human brain", "airplanes", "budgeting", "deserts", "the Silk Road", "robots", "hiking", "snow",
    "electricity", "the Vikings", "bats", "origami", "nutrition", "the Eiffel Tower", "social media",
    "lightning", "cheese making", "the violin", "marathons", "bridges", "wolves", "the metric system",
    "photography", "glaciers", "the Moon", "saving money", "board games", "tornadoes",
]
TEMPLATES = [
    "Explain {t} in simple terms.", "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.", "Why is {t} important?", "Give me a brief history of {t}.",
    "How would you explain {t} to a ten-year-old?", "List some common misconceptions about {t}.",
    "Write a short poem about {t}.", "What are the pros and cons of {t}?", "Summarize what you know about {t}.",
    "Give me five tips related to {t}.", "Write a short story that involves {t}.",
    "What questions do scientists still ask about {t}?", "Describe {t} in three sentences.",
    "Compare {t} with something from everyday life.", "What should a beginner know about {t}?",
    "Write a friendly email to a friend about {t}.", "Tell me a fun fact about {t}.",
    "What is the future of {t}?", "Explain how {t} works, step by step.",
    "Write a dialogue between a teacher and a student about {t}.", "What are the main ideas behind {t}?",
    "Why do people find {t} interesting?", "Write a short news report about {t}.",
]
EXTRA_PROMPTS = [
    "Write a Python function that reverses a string.", "What is 17 times 23? Show your steps.",
    "Write a haiku about autumn.", "Translate 'good morning' into French and Spanish.",
    "Write an email asking my manager for a day off.", "What is the capital of Japan?",
    "Give me a recipe for pancakes.", "What is the difference between weather and climate?",
    "Write a limerick about a cat.", "How many days are in a leap year?", "Suggest a name for a pet goldfish.",
    "Write a SQL query that counts rows in a table named users.", "What are prime numbers?",
    "Tell me a joke about computers.", "Describe your ideal weekend.", "How do airplanes stay in the air?",
    "Write a short motivational message for a student.", "What is a noun? Give examples.",
    "Explain recursion with an example in Python.",
]


def build_prompts(num: int, seed: int) -> list[str]:
    """``num`` distinct user messages, shuffled with ``seed``."""
    pool = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS] + EXTRA_PROMPTS
    rng = random.Random(seed)
    rng.shuffle(pool)
    if num > len(pool):
        raise SystemExit(f"--num-prompts {num}: at most {len(pool)} distinct prompts are built")
    return pool[:num]


# ------------------------------------------------------------------ data from the target
def self_prompts(engine, num: int, seed: int, max_new_tokens: int = 96) -> list[str]:
    """``num`` distinct user messages written by the target: sampled (temperature 1,
    top-p 0.95) from its chat template cut where the user's text would start, keeping
    those that end by themselves."""
    tok = engine.tokenizer.hf
    marker = "\x00USER\x00"
    full = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    prefix = tok.encode(full[:full.index(marker)], add_special_tokens=False)
    out: list[str] = []
    seen: set[str] = set()
    round_ = 0
    while len(out) < num and round_ < 8:
        want = int((num - len(out)) * 1.3) + 8
        params = [{"temperature": 1.0, "top_p": 0.95, "max_new_tokens": max_new_tokens,
                   "seed": seed * 1_000_003 + round_ * want + i}
                  for i in range(want)]
        for o in engine.generate(input_ids=[prefix] * want, sampling_params=params):
            text = o["text"].strip()
            if o["meta_info"]["finish_reason"]["type"] == "stop" and len(text) >= 12 and text not in seen:
                seen.add(text)
                out.append(text)
        round_ += 1
    return out[:num]


def generate(engine, prompts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per prompt."""
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
    return [(p, o["output_ids"]) for p, o in zip(ids, outs)]


def capture(engine, seqs: list[list[int]], layers: tuple[int, ...], max_batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The target's hidden states after ``layers`` (concatenated, ``[n, len(layers) H]``) at
    every position of every sequence: extend passes of the engine's own model runner."""
    from radixserve.engine.request import Req
    from radixserve.layers.attention import ForwardMode
    from radixserve.sampling import SamplingParams

    runner = engine.runner
    engine.flush_cache()
    page = runner.kv_pool.page_size
    out: list[torch.Tensor] = []
    i = 0
    while i < len(seqs):
        group, total = [], 0
        while i < len(seqs) and (not group or total + len(seqs[i]) <= max_batch_tokens):
            group.append(seqs[i])
            total += len(seqs[i])
            i += 1
        reqs = []
        try:
            for k, s in enumerate(group):
                r = Req(f"capture-{i}-{k}", list(s), SamplingParams(max_new_tokens=0), 0)
                r.req_pool_idx = runner.req_to_token_pool.alloc()
                reqs.append(r)
                r.pages = runner.kv_pool.allocator.allocate(-(-len(s) // page))
            with torch.inference_mode():
                batch = runner.build_batch(reqs, ForwardMode.EXTEND, [len(s) for s in group])
                batch.capture_hidden_layers = tuple(layers)
                runner.forward(batch)
                hidden = batch.extra["aux_hidden"]
            hidden = hidden.clone()  # out of inference mode: usable by autograd later
            off = 0
            for s in group:
                out.append(hidden[off:off + len(s)])
                off += len(s)
        finally:
            for r in reqs:
                runner.kv_pool.allocator.free(r.pages)
                runner.req_to_token_pool.free(r.req_pool_idx)
    return out


def output_embedding(engine) -> torch.Tensor:
    """The target's LM head weight ``[V, H]`` (the embedding when tied)."""
    model = engine.runner.model
    if engine.model_config.tie_word_embeddings:
        return model.embed_tokens.dense_weight()
    for name, t in engine.checkpoint.weights():
        if name.removeprefix("model.") == "lm_head.weight":
            return (t.dequantize() if hasattr(t, "dequantize") else t).to(torch.float32)  # GGUF blocks or float
    raise SystemExit("the target's LM head weight was not found in its checkpoint; use --loss hard")


# ------------------------------------------------------------------ training
class Example:
    """One prompt + answer: ids ``[n]``, aux hidden ``[n, 3H]``, last-layer hidden ``[n, H]``."""

    def __init__(self, ids: list[int], prompt_len: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        self.ids, self.prompt_len, self.aux, self.last = ids, prompt_len, aux, last


def make_batch(examples: list[Example], steps: int, t2d: torch.Tensor):
    """Padded tensors: ids ``[B, T + steps + 2]``, aux ``[B, T, 3H]``, last ``[B, T + steps + 2, H]``,
    label mask ``[B, T + steps + 2]`` (answer tokens in the draft vocabulary)."""
    b = len(examples)
    t = max(len(e.ids) for e in examples)
    width = t + steps + 2
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.bool)
    aux = torch.zeros(b, t, examples[0].aux.shape[1])
    last = torch.zeros(b, width, examples[0].last.shape[1])
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        mask[i, e.prompt_len:n] = True
        aux[i, :n] = e.aux
        last[i, :n] = e.last
    mask &= t2d[ids]
    return ids, mask, aux, last, t


def ttt_attention(head, cache: list, b: int, t: int):
    """The attention of one training-time-test step: step 0 is causal over its own keys;
    step ``k`` sees step 0's keys up to its row and its own row's keys of steps 1..k."""
    nh, nkv, d = head.config.num_attention_heads, head.config.num_key_value_heads, head.config.head_dim
    scale = d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def attend(q, k, v):
        q = q.view(b, t, nh, d).transpose(1, 2)  # [B, nh, T, D]
        k = k.view(b, t, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.view(b, t, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        cache.append((k, v))
        k0, v0 = cache[0]
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [B, nh, T, T]
        scores += [(q * km).sum(-1, keepdim=True) * scale for km, _ in cache[1:]]  # [B, nh, T, 1] each
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        o = p[..., :t] @ v0
        for m, (_, vm) in enumerate(cache[1:]):
            o = o + p[..., t + m:t + m + 1] * vm
        return o.transpose(1, 2).reshape(b * t, nh, d)

    return attend


def unroll(head, batch, steps: int, target_norm, out_embed_draft: torch.Tensor | None):
    """Per step: (draft logits at the label rows ``[N, Vd]``, labels as draft ids ``[N]``,
    soft targets ``[N, Vd]`` or None)."""
    ids, mask, aux, last, t = batch
    b = ids.shape[0]
    hidden = head.project(aux).reshape(b * t, -1)  # [B T, H]
    positions = torch.arange(t).repeat(b)
    cache: list = []
    attend = ttt_attention(head, cache, b, t)
    draft_of = torch.cumsum(head.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    out = []
    for k in range(steps):
        next_ids = ids[:, k + 1:k + 1 + t].reshape(-1)
        hidden = head(next_ids, hidden, positions + k, attend)  # [B T, H]
        rows = mask[:, k + 2:k + 2 + t].reshape(-1).nonzero().squeeze(1)
        logits = head.logits(hidden[rows])  # [N, Vd]
        labels = draft_of[ids[:, k + 2:k + 2 + t].reshape(-1)[rows]]
        soft = None
        if out_embed_draft is not None:
            with torch.no_grad():
                h = last[:, k + 1:k + 1 + t].reshape(b * t, -1)[rows]
                soft = torch.softmax(target_norm(h) @ out_embed_draft.T, dim=-1)  # [N, Vd]
        out.append((logits, labels, soft))
    return out


def loss_of(steps_out, decay: float = 0.8) -> torch.Tensor:
    total = 0.0
    for k, (logits, labels, soft) in enumerate(steps_out):
        if not labels.numel():
            continue
        logp = torch.log_softmax(logits, dim=-1)
        step_loss = -(soft * logp).sum(-1).mean() if soft is not None else F.nll_loss(logp, labels)
        total = total + decay ** k * step_loss
    return total


@torch.no_grad()
def evaluate(head, examples, steps, t2d, batch_size) -> list[float]:
    """Top-1 accuracy of each draft step over every answer token (tokens outside the draft
    vocabulary count as misses)."""
    hits, totals = [0] * steps, [0] * steps
    for i in range(0, len(examples), batch_size):
        group = examples[i:i + batch_size]
        for k, (logits, labels, _) in enumerate(unroll(head, make_batch(group, steps, t2d), steps, None, None)):
            hits[k] += int((logits.argmax(-1) == labels).sum())
        for k in range(steps):  # every answer token predicted at step k, in the draft vocab or not
            totals[k] += sum(max(0, len(e.ids) - max(e.prompt_len, k + 2)) for e in group)
    return [h / n if n else 0.0 for h, n in zip(hits, totals)]


def init_head(head, out_embed_draft: torch.Tensor, seed: int) -> None:
    """Small random weights, except: ``fc`` starts by passing the high aux state through
    (the residual stream begins as the target's own late hidden state) and the LM head
    starts as the target's, restricted to the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    h = head.config.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h:].copy_(torch.eye(h))
        head.lm_head.weight.copy_(out_embed_draft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for config.json and model.safetensors")
    ap.add_argument("--model", default=None, help="target model (default: radixserve's default model)")
    ap.add_argument("--num-prompts", type=int, default=512, help="prompts from the topic x template lists")
    ap.add_argument("--self-prompts", type=int, default=1536, help="prompts written by the target (Magpie)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--holdout", type=float, default=0.1, help="fraction of prompts kept for the accuracy check")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    ap.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per training row")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--loss", choices=("soft", "hard"), default="soft")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                    help="matmuls while training (bf16: autocast, ~3x faster on CPUs with AVX512-BF16 or AMX, "
                         "several times slower without; the weights stay float32). Default: bf16 where this "
                         "CPU has native bf16, else fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--data-cache", default=None, help="save the generated data and features here, or reuse them")
    args = ap.parse_args()
    if args.precision is None:
        from radixserve.kernels.woq import cpu_has_native_bf16

        native, why = cpu_has_native_bf16()
        args.precision = "bf16" if native else "fp32"
        print(f"training precision: {args.precision} ({'native bf16' if native else why})")

    import radixserve
    from radixserve_speculative_eagle3.checkpoint import make_config, vocab_mapping, write_head
    from radixserve_speculative_eagle3.head import Eagle3Config, Eagle3Head, default_aux_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()
    engine = radixserve.Engine(args.model, max_total_tokens=1 << 16, num_threads=args.threads, log_level="warning")
    try:
        cfg = engine.model_config
        layers = default_aux_layers(cfg.num_hidden_layers)
        h = cfg.hidden_size
        if args.data_cache and os.path.exists(args.data_cache):
            data = torch.load(args.data_cache)
            print(f"data: {len(data['pairs'])} answers from {args.data_cache}")
        else:
            t0 = time.monotonic()
            prompts = self_prompts(engine, args.self_prompts, args.seed) if args.self_prompts else []
            print(f"the target wrote {len(prompts)} prompts in {time.monotonic() - t0:.0f} s")
            prompts += build_prompts(args.num_prompts, args.seed)
            random.Random(args.seed).shuffle(prompts)
            t0 = time.monotonic()
            pairs = generate(engine, prompts, args.max_new_tokens)
            n_answer = sum(len(a) for _, a in pairs)
            print(f"generated {n_answer} answer tokens for {len(pairs)} prompts in {time.monotonic() - t0:.0f} s")
            t0 = time.monotonic()
            hidden = capture(engine, [p + a for p, a in pairs], layers + (cfg.num_hidden_layers - 1,))
            print(f"captured hidden states of {sum(x.shape[0] for x in hidden)} positions in "
                  f"{time.monotonic() - t0:.0f} s")
            data = {"pairs": pairs, "hidden": hidden}
            if args.data_cache:
                torch.save(data, args.data_cache)
        target = engine.runner.model
        embed = target.embed_tokens.dense_weight()
        out_embed = output_embedding(engine) if args.loss == "soft" else None
        # the target's final norm, applied outside its kernels (plain PyTorch)
        eps, norm_w = target.norm.eps, target.norm.weight.detach()

        def target_norm(x):
            return norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        examples = [Example(p + a, len(p), hs[:, :3 * h], hs[:, 3 * h:]) for (p, a), hs in
                    zip(data["pairs"], data["hidden"])]
        num_eval = max(1, int(len(examples) * args.holdout))
        eval_set, train_set = examples[:num_eval], examples[num_eval:]
        counts = Counter(t for e in train_set for t in e.ids[e.prompt_len:])
        vocab = min(args.draft_vocab_size, cfg.vocab_size)
        d2t, t2d = vocab_mapping(counts, vocab, cfg.vocab_size)
        covered = sum(c for t, c in counts.items() if t2d[t]) / max(1, sum(counts.values()))
        print(f"draft vocabulary: {vocab} tokens cover {covered:.1%} of the training answers")

        config = make_config(cfg, vocab, layers)
        head = Eagle3Head(Eagle3Config.from_dict(config))
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.set_embed(embed)
        head.build_rotary(max(len(e.ids) for e in examples) + args.ttt_steps + 2)
        draft_ids = d2t + torch.arange(vocab)
        lm_rows = (out_embed if out_embed is not None else output_embedding(engine))[draft_ids].clone()
        init_head(head, lm_rows, args.seed)
        out_embed_draft = lm_rows if args.loss == "soft" else None

        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
        per_epoch = math.ceil(len(train_set) / args.batch_size)
        total = per_epoch * args.epochs if args.steps is None else min(args.steps, per_epoch * args.epochs)
        warmup = max(1, total // 20)

        def lr_at(step):
            if step < warmup:
                return args.lr * (step + 1) / warmup
            return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        rng = random.Random(args.seed)
        t0 = time.monotonic()
        step = 0
        head.train()
        for epoch in range(args.epochs):
            if step >= total:
                break
            order = sorted(train_set, key=lambda e: len(e.ids))  # similar lengths per batch
            batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
            rng.shuffle(batches)
            running = 0.0
            for group in batches:
                if step >= total:
                    break
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    loss = loss_of(unroll(head, make_batch(group, args.ttt_steps, t2d), args.ttt_steps,
                                          target_norm, out_embed_draft))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                running += loss.item()
                step += 1
            head.eval()
            acc = evaluate(head, eval_set, args.ttt_steps, t2d, args.batch_size)
            head.train()
            print(f"epoch {epoch + 1}: {step} steps, mean loss {running / max(1, len(batches)):.3f}, "
                  f"held-out top-1 accuracy per draft step {' '.join(f'{a:.3f}' for a in acc)} "
                  f"({time.monotonic() - t0:.0f} s)")
        head.eval()
        acc = evaluate(head, eval_set, args.ttt_steps, t2d, args.batch_size)
        chain = 1.0 + sum(math.prod(acc[:k + 1]) for k in range(len(acc)))
        print(f"held-out top-1 accuracy, first draft step: {acc[0]:.3f} ({len(eval_set)} prompts); "
              f"later steps {' '.join(f'{a:.3f}' for a in acc[1:])}; expected tokens per verify with a "
              f"{len(acc)}-token chain ~ {chain:.2f}")
        tensors = {k: v for k, v in head.state_dict().items()}
        write_head(args.out, config, tensors)
        print(f"wrote {args.out} in {time.monotonic() - t_start:.0f} s in total")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
