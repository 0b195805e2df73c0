"""radixserve speculative method ``eagle3`` (alias ``eagle``): an EAGLE-3 draft head.

The head (``--speculative-draft-model-path DIR``: an SGLang/SpecForge
``LlamaForCausalLMEagle3`` checkpoint, see :mod:`.checkpoint`) is one decoder layer over
the target's own hidden states after three of its layers (the config's
``eagle_config.eagle_aux_hidden_state_layer_ids``, by default ``[1, L//2 - 1, L - 4]``),
with the target's embedding and an LM head over a smaller draft vocabulary. It runs
through :class:`radixserve.speculative.draft_model.DraftModel` (its K/V at the target's
slots, batched over requests): a best-first tree of ``--speculative-num-steps`` levels
(3) and ``--speculative-eagle-topk`` branches (4) with ``--speculative-num-draft-tokens``
verify tokens (8) by default, a chain with topk 1. On the default model and this CPU the
tree measured 1.17x at batch 1 against the chain's 1.06x (BENCHMARKS.md).
``scripts/train_eagle3.py`` trains a head for the default model on CPU.
"""

from __future__ import annotations

from radixserve.hookspecs import hookimpl

NAMES = ("eagle3", "eagle")


def make_proposer(ctx):
    """The factory: loads the head named by ``--speculative-draft-model-path``."""
    from radixserve_speculative_eagle3.proposer import Eagle3Proposer

    return Eagle3Proposer(ctx)


@hookimpl
def register_speculative_algorithms(register):
    for name in NAMES:
        register(name, make_proposer,
                 description="EAGLE-3 draft head over the target's hidden states (--speculative-draft-model-path)",
                 defaults={"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8,
                           "speculative_disable_by_batch_size": 1})
