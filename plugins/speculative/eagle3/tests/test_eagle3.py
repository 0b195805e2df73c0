"""EAGLE-3: checkpoint layout, the head's math against a reference written from the
layout, the aux-layer capture against transformers, and lossless serving on a tiny target."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import radixserve
import torch
from radixserve.models.config import ModelConfig
from radixserve.testing import speculative_conformance as sc
from radixserve_speculative_eagle3 import DEFAULTS
from radixserve_speculative_eagle3.checkpoint import (
    expected_shapes,
    load_head,
    make_config,
    read_tensors,
    vocab_mapping,
    write_head,
)
from radixserve_speculative_eagle3.head import Eagle3Config, default_aux_layers

DRAFT_VOCAB = 128
# a tree of 3 levels x 4 branches in 8 verify tokens (the defaults on CPU are a one-draft chain)
TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}


def target_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as fh:
        return ModelConfig.from_hf_dict(json.load(fh))


def random_head_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of O(1) activations for every tensor of the layout."""
    cfg = Eagle3Config.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name in ("d2t", "t2d"):
            continue
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.2 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    counts = {t: int(c) for t, c in enumerate(torch.randint(0, 50, (cfg.vocab_size,), generator=g))}
    out["d2t"], out["t2d"] = vocab_mapping(counts, cfg.draft_vocab_size, cfg.vocab_size)
    return out


def write_random_head(path: str, target: ModelConfig, seed: int = 0, **config_overrides) -> dict:
    config = {**make_config(target, DRAFT_VOCAB), **config_overrides}
    tensors = random_head_tensors(config, seed)
    write_head(path, config, tensors)
    return tensors


# ------------------------------------------------------------------ checkpoint layout
def test_writer_and_loader_round_trip(tiny_target, tmp_path):
    tcfg = target_config(tiny_target[0])
    tensors = write_random_head(str(tmp_path), tcfg)
    with open(tmp_path / "config.json") as fh:
        config = json.load(fh)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 300
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["tie_word_embeddings"] is False
    stored = read_tensors(str(tmp_path))
    h, d = 64, 16
    assert {k: tuple(v.shape) for k, v in stored.items()} == {
        "fc.weight": (h, 3 * h), "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (4 * d, 2 * h), "midlayer.self_attn.k_proj.weight": (2 * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (2 * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, 4 * d),
        "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (128, h),
        "midlayer.mlp.up_proj.weight": (128, h), "midlayer.mlp.down_proj.weight": (h, 128),
        "norm.weight": (h,), "lm_head.weight": (DRAFT_VOCAB, h), "d2t": (DRAFT_VOCAB,), "t2d": (300,)}
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    # the mapping's invariant: nonzero(t2d) == d2t + arange(Vd), ascending
    assert torch.equal(stored["t2d"].nonzero().squeeze(1), stored["d2t"] + torch.arange(DRAFT_VOCAB))
    head = load_head(str(tmp_path), tcfg)
    for name, t in head.state_dict().items():
        assert torch.equal(t, tensors[name]), name
    assert head.config.aux_layer_ids is None  # no eagle_config: the default layers
    assert default_aux_layers(8) == (1, 3, 4)


def test_loader_accepts_prefixed_names_and_ignores_an_embedding(tiny_target, tmp_path):
    from safetensors.torch import save_file

    tcfg = target_config(tiny_target[0])
    tensors = write_random_head(str(tmp_path), tcfg)
    prefixed = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in tensors.items()}
    prefixed["model.embed_tokens.weight"] = torch.zeros(300, 64)
    os.remove(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in prefixed.items()}, str(tmp_path / "model.safetensors"))
    head = load_head(str(tmp_path), tcfg)
    assert torch.equal(head.fc.weight, tensors["fc.weight"])


def test_vocab_mapping_pads_and_sorts():
    d2t, t2d = vocab_mapping({7: 5, 3: 9, 11: 1}, 5, 20)
    ids = (d2t + torch.arange(5)).tolist()
    assert ids == [0, 1, 3, 7, 11]  # the three seen plus the lowest unseen ids, ascending
    assert t2d.nonzero().squeeze(1).tolist() == ids
    d2t, _ = vocab_mapping({7: 5, 3: 9, 11: 1}, 2, 20)
    assert (d2t + torch.arange(2)).tolist() == [3, 7]  # the two most frequent


def test_loader_errors(tiny_target, tmp_path):
    tcfg = target_config(tiny_target[0])
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        load_head(None, tcfg)
    with pytest.raises(ValueError, match="--speculative-draft-model-path .*not a directory"):
        load_head(str(tmp_path / "nowhere"), tcfg)
    # a plain Llama checkpoint is not a head
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        load_head(tiny_target[0], tcfg)
    # a head for a wider target
    wide = str(tmp_path / "wide")
    wcfg = ModelConfig(**{**tcfg.__dict__, "hidden_size": 96, "raw": {}})
    write_random_head(wide, wcfg)
    with pytest.raises(ValueError, match="hidden size is 96 .* target model's is 64"):
        load_head(wide, tcfg)
    # missing tensors are named
    ok = str(tmp_path / "ok")
    tensors = write_random_head(ok, tcfg)
    from safetensors.torch import save_file

    del tensors["midlayer.hidden_norm.weight"], tensors["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(ok, "model.safetensors"))
    with pytest.raises(ValueError, match="missing 2 tensors: lm_head.weight, midlayer.hidden_norm.weight"):
        load_head(ok, tcfg)
    # aux layers that are not three distinct layers of the target (named, or the default for a short target)
    dup = str(tmp_path / "dup")
    write_random_head(dup, tcfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]})
    with pytest.raises(ValueError, match="three distinct layers"):
        load_head(dup, tcfg)
    short = ModelConfig(**{**tcfg.__dict__, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="the default layers .* name them in the config"):
        load_head(ok, short)


def test_aux_layers_come_from_the_config(tiny_target, tmp_path):
    tcfg = target_config(tiny_target[0])
    path = str(tmp_path / "head")
    write_random_head(path, tcfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 6]})
    engine = radixserve.Engine(tiny_target[0], speculative_algorithm="eagle3", speculative_draft_model_path=path,
                               max_total_tokens=512)
    try:
        assert engine.scheduler.spec.proposer.hidden_layers == (0, 2, 6)
        assert engine.runner.capture_hidden_layers == (0, 2, 6)
    finally:
        engine.shutdown()
    write_random_head(path, tcfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]})
    with pytest.raises(ValueError, match=r"\[1, 3, 8\] must be three distinct layers of the target's 8"):
        load_head(path, tcfg)


def test_engine_names_the_flag_without_a_draft_path(tiny_target):
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        radixserve.Engine(tiny_target[0], speculative_algorithm="EAGLE3", max_total_tokens=512)


# ------------------------------------------------------------------ aux hidden states
def test_aux_capture_matches_transformers_hidden_states(tiny_target):
    """The hidden state after 0-based layer ``l`` is transformers' ``hidden_states[l + 1]``
    (for the last layer, transformers applies the final norm first)."""
    from train_eagle3 import capture

    path, hf = tiny_target
    ids = [1, 17, 42, 99, 5, 260, 8, 8, 31, 77, 150, 3]
    layers = (1, 3, 4, 7)
    engine = radixserve.Engine(path, max_total_tokens=1024, attention_backend="torch_native")
    try:
        got = capture(engine, [ids, ids[:5]], layers)
    finally:
        engine.shutdown()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = torch.cat([ref[i + 1][0] for i in layers[:3]], dim=-1)
        last = hf.model.norm(got[0][:, 3 * 64:])
    assert got[0].shape == (len(ids), 4 * 64)
    torch.testing.assert_close(got[0][:, :3 * 64], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, ref[8][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], got[0][:5], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the head's math
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """Rotate-half RoPE on ``x  # [T, heads, D]`` (transformers' Llama convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions[:, None].float() * inv  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def reference_chain(w: dict, cfg: dict, embed: torch.Tensor, ids: list[int], aux: torch.Tensor,
                    steps: int) -> list[int]:
    """The draft tokens an EAGLE-3 head proposes after ``ids``, written from the layout:
    row ``j`` = fc(aux[j]) with the embedding of ``ids[j + 1]`` at position ``j``; then
    ``steps - 1`` levels feeding the previous output and the drafted token at the next
    positions. ``aux  # [len(ids) - 1, 3H]``: the target's hidden states after the aux layers."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    keys, values = [], []

    def layer(tok_ids, hidden, positions):
        e = embed[torch.tensor(tok_ids)]
        a = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps),
                       _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
        t = a.shape[0]
        q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d)
        k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d)
        v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d)
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        keys.append(k)
        values.append(v)
        kk, vv = torch.cat(keys), torch.cat(values)  # every row so far, in position order
        kk, vv = kk.repeat_interleave(nh // nkv, dim=1), vv.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(d)
        n = kk.shape[0]
        causal = torch.arange(n)[None, :] <= (torch.arange(t) + n - t)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), vv).reshape(t, nh * d)
        h1 = hidden + o @ w["midlayer.self_attn.o_proj.weight"].T
        x = _rms(h1, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(x @ w["midlayer.mlp.gate_proj.weight"].T)
               * (x @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        h2 = h1 + mlp
        logits = _rms(h2, w["norm.weight"], eps) @ w["lm_head.weight"].T
        best = int(logits[-1].argmax())
        return h2[-1:], best + int(w["d2t"][best])

    n = len(ids)
    hidden, tok = layer(ids[1:], aux @ w["fc.weight"].T, torch.arange(n - 1))
    out = [tok]
    for level in range(1, steps):
        hidden, tok = layer([tok], hidden, torch.tensor([n - 2 + level]))
        out.append(tok)
    return out


def _record_drafts(engine) -> list:
    """Wrap the engine's proposer: every (request tokens at propose time, draft)."""
    proposer = engine.scheduler.spec.proposer
    inner = proposer.propose
    log = []

    def propose(reqs, max_tokens):
        out = inner(reqs, max_tokens)
        log.extend((list(r.all_ids), d) for r, d in zip(reqs, out))
        return out

    proposer.propose = propose
    return log


PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [40, 41, 42, 40, 41], list(range(20, 60)),
           [100, 3, 77, 100, 3, 77, 100], [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13]]


def test_drafts_match_a_reference_written_from_the_layout(tiny_target, tmp_path):
    """Every draft of a run (after prefill, and after verify steps) equals the reference
    chain over transformers' hidden states of the same tokens."""
    path, hf = tiny_target
    tcfg = target_config(path)
    head_dir = str(tmp_path / "head")
    w = write_random_head(head_dir, tcfg, seed=5)
    with open(os.path.join(head_dir, "config.json")) as fh:
        cfg = json.load(fh)
    engine = radixserve.Engine(path, max_total_tokens=2048, speculative_algorithm="eagle3",
                               speculative_draft_model_path=head_dir, chunked_prefill_size=16,
                               speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                               speculative_disable_by_batch_size=1 << 20,
                               speculative_draft_model_quantization="none")  # float32, as the reference
    try:
        log = _record_drafts(engine)
        engine.generate(input_ids=PROMPTS[:3], sampling_params={"temperature": 0.0, "max_new_tokens": 10})
    finally:
        engine.shutdown()
    embed = hf.model.embed_tokens.weight.detach()
    layers = default_aux_layers(8)
    checked = 0
    for ids, draft in log:
        assert draft is not None and draft.node_parents() == list(range(-1, len(draft.tokens)))  # a chain
        with torch.no_grad():
            hs = hf(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i + 1][0] for i in layers], dim=-1)
        want = reference_chain(w, cfg, embed, ids, aux, 3)
        assert draft.tokens == want[:len(draft.tokens)], (ids, draft.tokens, want)
        checked += 1
    assert checked >= 6


# ------------------------------------------------------------------ serving
def train_tiny_head(path: str, out: str, prompts: list[list[int]], *, steps: int = 150, seed: int = 0) -> None:
    """A head for the tiny target, trained with the trainer's functions on the target's own
    greedy continuations of ``prompts`` (memorised, so that its drafts get accepted)."""
    from collections import Counter

    import train_eagle3 as trainer
    from radixserve_speculative_eagle3.head import Eagle3Head

    tcfg = target_config(path)
    engine = radixserve.Engine(path, max_total_tokens=4096, attention_backend="torch_native")
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 40})
        seqs = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        layers = default_aux_layers(tcfg.num_hidden_layers)
        hidden = trainer.capture(engine, seqs, layers)
        embed = engine.runner.model.embed_tokens.weight.detach().clone()
    finally:
        engine.shutdown()
    examples = [trainer.Example(s, len(p), hs, hs[:, :0]) for s, p, hs in zip(seqs, prompts, hidden)]
    counts = Counter(t for e in examples for t in e.ids[e.prompt_len:])
    d2t, t2d = vocab_mapping(counts, DRAFT_VOCAB, tcfg.vocab_size)
    config = make_config(tcfg, DRAFT_VOCAB, layers)
    head = Eagle3Head(Eagle3Config.from_dict(config))
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.set_embed(embed)
    head.build_rotary(128)
    trainer.init_head(head, embed[d2t + torch.arange(DRAFT_VOCAB)], seed)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    batch = trainer.make_batch(examples, 3, t2d)
    for _ in range(steps):
        loss = trainer.loss_of(trainer.unroll(head, batch, 3, None, None))
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = trainer.evaluate(head, examples, 3, t2d, len(examples))
    assert acc[0] > 0.5, f"the tiny head did not learn its data: accuracy per step {acc}"
    write_head(out, config, dict(head.state_dict()))


@pytest.fixture(scope="module")
def random_head(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eagle3-random-head"))
    write_random_head(path, target_config(tiny_target[0]), seed=1)
    return path


@pytest.fixture(scope="module")
def trained_head(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("eagle3-trained-head"))
    train_tiny_head(tiny_target[0], path, PROMPTS)
    return path


def test_random_head_is_lossless(tiny_target, random_head):
    """Greedy tokens equal plain decoding's: one batch, one at a time with the radix cache
    warm, chunked prefill (the conformance suite, which also checks every draft's contract
    and the engine's idle invariant)."""
    stats = sc.check_greedy_parity("EAGLE3", tiny_target[0], PROMPTS, max_new_tokens=24,
                                   speculative_draft_model_path=random_head, **TREE)
    assert stats["spec_num_proposer_errors"] == 0 and stats["spec_eagle_missing_roots"] == 0


@pytest.mark.parametrize("topk", [1, 2])
def test_trained_head_gets_drafts_accepted_losslessly(tiny_target, trained_head, topk):
    stats = sc.check_greedy_parity("eagle", tiny_target[0], PROMPTS, max_new_tokens=32,
                                   speculative_draft_model_path=trained_head, speculative_num_steps=3,
                                   speculative_eagle_topk=topk)
    assert stats["spec_num_proposer_errors"] == 0
    assert stats["spec_accept_length"] > 2.5, stats  # the drafts do run ahead of the target


def test_trained_head_leaks_nothing(tiny_target, trained_head):
    """Aborts mid-speculation and retraction in a small pool keep every page and slot."""
    sc.check_no_leaks("eagle3", tiny_target[0], PROMPTS, speculative_draft_model_path=trained_head, **TREE)


def test_defaults_are_a_one_draft_chain_on_cpu(tiny_target, random_head):
    with radixserve.Engine(tiny_target[0], speculative_algorithm="eagle3", speculative_draft_model_path=random_head,
                           max_total_tokens=512) as eng:
        spec = eng.scheduler.spec
        assert (spec.proposer.num_steps, spec.proposer.topk, spec.num_draft_tokens) == (1, 1, 2)
    assert DEFAULTS["speculative_num_steps"](SimpleNamespace(device=torch.device("cuda"))) == 3
    assert DEFAULTS["speculative_num_draft_tokens"](SimpleNamespace(device=torch.device("cuda"))) == 8
    with radixserve.Engine(tiny_target[0], speculative_algorithm="eagle3", speculative_draft_model_path=random_head,
                           speculative_num_steps=3, max_total_tokens=512) as eng:
        assert eng.scheduler.spec.num_draft_tokens == 4  # a chain of 3: the verify width follows


def test_trained_head_with_tp2(tiny_target, trained_head):
    """--tp-size 2: the head runs whole on rank 0 over the target's hidden states (rank 0 has
    the whole residual stream) and the target's embedding gathered from both ranks' vocabulary
    slices; greedy tokens equal one rank's plain decoding and drafts are still accepted."""
    with radixserve.Engine(tiny_target[0], max_total_tokens=2048) as one:
        want = [o["output_ids"] for o in one.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 32})]
        vocab = torch.arange(one.model_config.vocab_size)
        table = one.runner.model.embed_tokens(vocab)  # [V, H] one rank's whole table
    stats = sc.check_greedy_parity("eagle3", tiny_target[0], PROMPTS, max_new_tokens=32, tp_size=2,
                                   max_total_tokens=2048, speculative_draft_model_path=trained_head,
                                   speculative_num_steps=3, speculative_eagle_topk=2)
    assert stats["spec_num_proposer_errors"] == 0 and stats["spec_accept_length"] > 2.5, stats
    with radixserve.Engine(tiny_target[0], tp_size=2, max_total_tokens=2048, speculative_algorithm="eagle3",
                           speculative_draft_model_path=trained_head, speculative_num_steps=3, page_size=16) as two:
        got = [o["output_ids"] for o in two.generate(input_ids=PROMPTS, sampling_params={
            "temperature": 0.0, "max_new_tokens": 32})]
        assert torch.equal(two.scheduler.spec.proposer.head.embed(vocab), table)  # gathered, in rank order
    assert got == want
