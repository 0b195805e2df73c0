"""A tiny Qwen3 reasoning checkpoint: Qwen3's real chat template, a tokenizer with single
``<think>`` / ``</think>`` tokens, and weights that make its greedy output predictable.

The weights are random (:func:`tiny_models.build_checkpoint`), except that the token
embeddings are scaled up and ``lm_head`` gets one strong row per entry of ``CHAIN``: the
residual stream is then dominated by the current token's embedding, so the model is in
effect a bigram model whose greedy next token after ``a`` is ``CHAIN[a]`` (every layer
still runs, its contribution is small). After the Qwen3 generation prompt
(``...<|im_start|>assistant\\n``) it thinks ``<think>hmm so ok</think>`` and answers
``fine thanks`` then ``<|im_end|>``; after a closed empty think block (``enable_thinking:
false``) it answers at once. Under a grammar the chain decides nothing once its token is
masked: the grammar's tokens follow, by the random rows.

The tokenizer is word-level (whitespace splits the prompt; unknown words are ``<unk>``)
with a fusing decoder (tokens join without spaces), and holds the characters JSON needs,
one token each, so a grammar backend can spell any JSON with it.
"""

from __future__ import annotations

import os
import string

import torch
from tiny_models import build_checkpoint

TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as in Qwen3)
WORDS = ["system", "user", "assistant", "hmm", "so", "ok", "fine", "thanks"]
CHARS = list(string.ascii_lowercase + string.digits + '{}[]":,.-_ ')
# greedy next token after each of these (the rest of the vocabulary follows the random rows)
CHAIN = {"assistant": "<think>", "<think>": "hmm", "hmm": "so", "so": "ok", "ok": "</think>",
         "</think>": "fine", "fine": "thanks", "thanks": "<|im_end|>"}
THOUGHT = "hmmsook"  # the reasoning of a thinking reply, as decoded (tokens fuse)
ANSWER = "finethanks"
EMBED_SCALE = 100.0
CHAIN_LOGIT = 40.0


def qwen3_template() -> str:
    with open(TEMPLATE_PATH) as fh:
        return fh.read().rstrip("\n")


def vocabulary() -> list[str]:
    """Base vocabulary then added tokens, in id order."""
    return ["<unk>"] + WORDS + CHARS + SPECIAL + ADDED


def save_reasoning_tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>"] + WORDS + CHARS
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(base)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = qwen3_template()
    fast.save_pretrained(path)


def build_reasoning_checkpoint(path: str, seed: int = 0) -> dict[str, int]:
    """Save the checkpoint to ``path``; returns the vocabulary (token -> id)."""
    vocab = {t: i for i, t in enumerate(vocabulary())}
    eos = vocab["<|im_end|>"]
    model = build_checkpoint(path, "qwen3", seed=seed, vocab_size=len(vocab), bos_token_id=vocab["<|endoftext|>"],
                             eos_token_id=eos, tie_word_embeddings=False, max_position_embeddings=512)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, H]
        embed.mul_(EMBED_SCALE)
        head = model.lm_head.weight  # [V, H]
        for a, b in CHAIN.items():
            h = model.model.norm(embed[vocab[a]])  # [H]: the final hidden state after `a`, layers aside
            head[vocab[b]] += CHAIN_LOGIT * h / h.dot(h)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    save_reasoning_tokenizer(path)
    return vocab
