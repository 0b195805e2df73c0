"""radixserve speculative method ``eagle3`` (alias ``eagle``): an EAGLE-3 draft head.

The head (``--speculative-draft-model-path DIR``: an SGLang/SpecForge
``LlamaForCausalLMEagle3`` checkpoint, see :mod:`.checkpoint`) is one decoder layer over
the target's own hidden states after three of its layers (the config's
``eagle_config.eagle_aux_hidden_state_layer_ids``, by default ``[1, L//2 - 1, L - 4]``),
with the target's embedding and an LM head over a smaller draft vocabulary. It runs
through :class:`radixserve.speculative.draft_model.DraftModel` (its K/V at the target's
slots, batched over requests): a best-first tree of ``--speculative-num-steps`` levels
and ``--speculative-eagle-topk`` branches with ``--speculative-num-draft-tokens`` verify
tokens, a chain with topk 1. Defaults: on CPU a chain of one draft token (over the default
model's Q4_1 blocks it measured 1.01-1.06x at batch 1 where the tree of 3 levels x 4
branches in 8 verify tokens lost 23-40 %: a verify row and a head pass cost too much there
for the ~1.8 tokens the tree gets accepted; BENCHMARKS.md, "EAGLE3 over the GGUF target" and
"EAGLE3 on the AVX-512 machine"); elsewhere that tree. ``scripts/train_eagle3.py`` trains a head for
the default model on CPU.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

NAMES = ("eagle3", "eagle")


def make_proposer(ctx):
    """The factory: loads the head named by ``--speculative-draft-model-path``."""
    from radixserve_speculative_eagle3.proposer import Eagle3Proposer

    return Eagle3Proposer(ctx)


def _per_device(cpu, other):
    """A default that depends on the target's device: ``cpu`` there, ``other`` elsewhere."""
    return lambda target: cpu if target.device.type == "cpu" else other


# (levels, branches, verify tokens): a chain of one draft on CPU (verify tokens: the core's
# levels * branches + 1, so a --speculative-num-steps flag alone sizes a chain), a tree elsewhere
DEFAULTS = {"speculative_num_steps": _per_device(1, 3), "speculative_eagle_topk": _per_device(1, 4),
            "speculative_num_draft_tokens": _per_device(None, 8), "speculative_disable_by_batch_size": 1}


@hookimpl
def register_speculative_algorithms(register):
    for name in NAMES:
        register(name, make_proposer,
                 description="EAGLE-3 draft head over the target's hidden states (--speculative-draft-model-path)",
                 defaults=DEFAULTS)
