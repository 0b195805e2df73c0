"""radixserve speculative method ``standalone``: drafts from a smaller model.

The draft is any checkpoint the core can load (a Hugging Face directory or a .gguf file,
``--speculative-draft-model-path``) whose vocabulary is the target's: a smaller model of the
same family, or one cut from the target (:func:`write_layerskip_draft`). It runs through
:class:`radixserve.speculative.draft_model.DraftModel`: its K/V live at the target's slots,
chains by default (``--speculative-num-steps`` 3, ``--speculative-eagle-topk`` 1), trees
with ``--speculative-eagle-topk`` > 1.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

__all__ = ["StandaloneProposer", "write_layerskip_draft"]


def __getattr__(name: str):
    # both import torch (and the core's model code): loaded on first use
    if name == "StandaloneProposer":
        from radixserve_speculative_standalone.proposer import StandaloneProposer

        return StandaloneProposer
    if name == "write_layerskip_draft":
        from radixserve_speculative_standalone.layerskip import write_layerskip_draft

        return write_layerskip_draft
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_speculative_algorithms(register):
    from radixserve_speculative_standalone.proposer import StandaloneProposer

    register("standalone", StandaloneProposer,
             description="drafts from a smaller model with the target's tokenizer (--speculative-draft-model-path)",
             defaults={"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_disable_by_batch_size": 1})
