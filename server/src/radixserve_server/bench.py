"""``radixserve bench``: a serving benchmark client for any OpenAI-compatible server.

Datasets: ``random`` (random token prompts of a given length), ``generated-shared-prefix``
(groups of questions behind one long system prompt, the ``--gsp-*`` knobs) and
``multi-turn`` (conversations whose every turn resends the history). Requests go out
under ``--max-concurrency`` and a Poisson ``--request-rate`` (``inf``: all at once), all
streamed, so each one yields its time to first token and the gaps between chunks.

Definitions (as in SGLang's bench_serving): TTFT is send to first content chunk; ITL is
the gap between consecutive content chunks; TPOT is ``(latency - TTFT) / (output tokens - 1)``
per request; throughputs divide totals by the benchmark's wall time. Output tokens come
from the server's ``usage`` (``stream_options.include_usage``) and, when it gives none,
from tokenising the text. The cache hit rate is cached prompt tokens / prompt tokens, from
``usage.prompt_tokens_details.cached_tokens``.

``ideal_compute`` is what a server with perfect prefix reuse (an unbounded cache, every
shared prefix computed once) must still run through the model: every request's prompt
(as the default chat template tokenizes it, or the plain prompt on the completions
endpoint) followed by its output, all merged in one prefix tree; each tree node is one
token to compute, except the last token of a sequence that nothing extends (a final
output token is never fed back). It is reported as the number of such tokens and the sum
of their positions (attention work grows with position), from which ``bench_serving.py``
derives the workload's compute limit on a machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any


# --------------------------------------------------------------- datasets
@dataclass
class BenchRequest:
    messages: list[dict[str, str]]  # chat form (the completions endpoint joins the contents)
    output_len: int
    conversation: int | None = None  # multi-turn: turns of one conversation run in order
    turn: int = 0


def _random_text(tok, rng: random.Random, length: int) -> str:
    vocab = len(tok.hf)
    special = set(tok.hf.all_special_ids)
    ids = []
    while len(ids) < length:
        t = rng.randrange(vocab)
        if t not in special:
            ids.append(t)
    return tok.decode(ids, skip_special_tokens=True)


def _length(rng: random.Random, full: int, ratio: float) -> int:
    return max(1, rng.randint(max(1, int(full * ratio)), full)) if ratio < 1 else full


def random_dataset(tok, args, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(args.num_prompts):
        n_in = _length(rng, args.random_input_len, args.random_range_ratio)
        n_out = _length(rng, args.random_output_len, args.random_range_ratio)
        out.append(BenchRequest([{"role": "user", "content": _random_text(tok, rng, n_in)}], n_out))
    return out


def shared_prefix_dataset(tok, args, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(args.gsp_num_groups):
        system = _random_text(tok, rng, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            question = _random_text(tok, rng, args.gsp_question_len)
            out.append(BenchRequest([{"role": "system", "content": system},
                                     {"role": "user", "content": question}], args.gsp_output_len))
    rng.shuffle(out)
    return out


def multi_turn_dataset(tok, args, rng: random.Random) -> list[BenchRequest]:
    """One first turn per conversation; later turns are made as answers arrive."""
    out = []
    for c in range(args.num_prompts):
        out.append(BenchRequest([{"role": "user", "content": _random_text(tok, rng, args.multi_turn_input_len)}],
                                args.multi_turn_output_len, conversation=c, turn=0))
    return out


DATASETS = {"random": random_dataset, "generated-shared-prefix": shared_prefix_dataset,
            "multi-turn": multi_turn_dataset}


# ----------------------------------------------------------------- client
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int = 0
    text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None  # what was sent (for ideal_compute)


async def send(client, args, model: str, req: BenchRequest, tok) -> Result:
    chat = args.endpoint == "chat"
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = req.messages
        url = "/v1/chat/completions"
    else:
        body["prompt"] = "\n\n".join(m["content"] for m in req.messages)
        url = "/v1/completions"
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    res = Result()
    start = time.perf_counter()
    last = None
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.text += piece
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens", 0)
        res.output_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")
    else:
        res.output_tokens = len(tok.encode(res.text, add_special_tokens=False))
    res.ok = last is not None
    if not res.ok:
        res.error = "no content received"
    return res


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms) if ms else 0.0, "median": _pct(ms, 0.5), "p99": _pct(ms, 0.99)}


async def run_benchmark(args, tok) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    requests = DATASETS[args.dataset_name](tok, args, rng)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        turns = args.multi_turn_turns if args.dataset_name == "multi-turn" else 1
        total = len(requests) * turns
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"{args.dataset_name} c={args.max_concurrency}", file=sys.stderr)
        sem = asyncio.Semaphore(args.max_concurrency or total or 1)
        results: list[Result] = []
        trng = random.Random(args.seed + 1)

        async def one(req: BenchRequest) -> None:
            for turn in range(turns):
                async with sem:
                    res = await send(client, args, model, req, tok)
                res.messages = req.messages
                results.append(res)
                if bar is not None:
                    bar.update(1)
                if turn + 1 < turns:
                    if not res.ok:  # the rest of a failed conversation counts as failed
                        results.extend(Result(error="earlier turn failed") for _ in range(turns - turn - 1))
                        return
                    text = _random_text(tok, trng, args.multi_turn_input_len)
                    req = BenchRequest(req.messages + [{"role": "assistant", "content": res.text},
                                                       {"role": "user", "content": text}],
                                       req.output_len, req.conversation, turn + 1)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return summarize(args, results, duration, model, tok)


def ideal_compute(sequences: list[list[int]]) -> dict[str, int]:
    """Tokens a perfect prefix cache must still compute for ``sequences`` (each a prompt
    followed by its output): the nodes of their prefix tree, less the final token of each
    sequence no other extends; ``position_sum`` adds up those tokens' positions (0-based)."""
    root: dict = {}
    tokens = position_sum = 0
    for seq in sequences:
        node = root
        for pos, t in enumerate(seq):
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                tokens += 1
                position_sum += pos
            node = child
    # leaves: sequence ends nobody extends; their last token is never run through the model
    stack = [(root, -1)]
    while stack:
        node, depth = stack.pop()
        if not node and depth >= 0:
            tokens -= 1
            position_sum -= depth
        stack.extend((child, depth + 1) for child in node.values())
    return {"tokens": tokens, "position_sum": position_sum}


def _sent_ids(args, tok, res: Result) -> list[int]:
    if args.endpoint == "chat":
        try:
            ids = tok.encode_chat(res.messages)
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain text
            ids = tok.encode("\n\n".join(m["content"] for m in res.messages))
    else:
        ids = tok.encode("\n\n".join(m["content"] for m in res.messages))
    return ids + tok.encode(res.text, add_special_tokens=False)


def summarize(args, results: list[Result], duration: float, model: str, tok=None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {
        "dataset": args.dataset_name, "endpoint": args.endpoint, "base_url": args.base_url, "model": model,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": in_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cache_hit_rate": (sum(cached) / in_tokens) if cached and in_tokens else None,
        "ttft_ms": _summary([r.ttft for r in ok]),
        "itl_ms": _summary([x for r in ok for x in r.itl]),
        "tpot_ms": _summary(tpot),
        "e2e_latency_ms": _summary([r.latency for r in ok]),
    }
    if tok is not None and ok and all(r.messages is not None for r in ok):
        report["ideal_compute"] = ideal_compute([_sent_ids(args, tok, r) for r in ok])
    return report


def format_report(rep: dict[str, Any]) -> str:
    hit = rep["cache_hit_rate"]
    lines = [
        f"{'dataset':<28}{rep['dataset']} ({rep['endpoint']}) against {rep['base_url']}",
        f"{'max concurrency':<28}{rep['max_concurrency']}   request rate: {rep['request_rate']}",
        f"{'completed / failed':<28}{rep['completed']} / {rep['failed']}",
        f"{'duration (s)':<28}{rep['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{rep['request_throughput']:.3f}",
        f"{'input throughput (tok/s)':<28}{rep['input_throughput']:.1f}",
        f"{'output throughput (tok/s)':<28}{rep['output_throughput']:.1f}",
        f"{'cache hit rate':<28}{'n/a' if hit is None else f'{hit:.1%}'}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E")):
        s = rep[key]
        lines.append(f"{label + ' (ms) mean/p50/p99':<28}{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}")
    if rep["errors"]:
        lines.append("errors: " + "; ".join(rep["errors"]))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="OpenAI endpoint to drive (chat works with most servers)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint whose tokenizer makes prompts and counts tokens (default: the default model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", choices=tuple(DATASETS), default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (multi-turn: conversations)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are drawn from [ratio * len, len]")
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--multi-turn-turns", type=int, default=4)
    p.add_argument("--multi-turn-input-len", type=int, default=64)
    p.add_argument("--multi-turn-output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: send all at once)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it; outputs may end early)")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the report as one JSON line")
    p.add_argument("--disable-tqdm", action="store_true")


def _check(args) -> None:
    from radixserve.config import ConfigError

    for name in ("num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
                 "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len",
                 "multi_turn_turns", "multi_turn_input_len", "multi_turn_output_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not 0 < args.random_range_ratio <= 1:
        raise ConfigError(f"--random-range-ratio must be in (0, 1], got {args.random_range_ratio}")


def _reason(e: Exception) -> str:
    """``connection refused`` from ``[Errno 111] Connection refused`` (and the like)."""
    text = str(e) or type(e).__name__
    if text.startswith("[Errno") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:1].lower() + text[1:]


class Unreachable(Exception):
    """The server cannot be reached (or does not answer as an OpenAI-compatible one)."""


def probe(args) -> str | None:
    """Reach the server before anything slow: ``GET /v1/models``; returns the model to use
    (``--model`` or the server's first). Raises Unreachable with one line naming the URL."""
    import httpx

    url = args.base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=30.0)
    except httpx.InvalidURL as e:
        raise Unreachable(f"--base-url {args.base_url!r}: {_reason(e)}") from None
    except httpx.HTTPError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(e, httpx.TimeoutException):
            why = "timed out"
        else:
            why = _reason(cause if isinstance(cause, OSError) else e)
        raise Unreachable(f"cannot reach {args.base_url}: {why}") from None
    if r.status_code != 200:
        raise Unreachable(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
    if args.model is not None:
        return args.model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise Unreachable(f"{url} did not list a model (give --model)") from None


def bench_command(args) -> int:
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    _check(args)
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    try:
        args.model = probe(args)
    except Unreachable as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 1
    ckpt = load_checkpoint(args.tokenizer)
    tok = load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file)
    report = asyncio.run(run_benchmark(args, tok))
    print(format_report(report))
    if args.output_file:
        with open(args.output_file, "a") as fh:
            fh.write(json.dumps(report) + "\n")
    return 0 if report["completed"] else 1


