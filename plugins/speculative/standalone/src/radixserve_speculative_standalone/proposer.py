"""The ``standalone`` proposer: a :class:`DraftModel` over a smaller checkpoint (imported by
the hook, so the entry point's module stays free of torch)."""

from __future__ import annotations

from radixserve.plugin_api.speculative import DraftModel, SpeculativeContext, load_module


class StandaloneProposer(DraftModel):
    """A :class:`DraftModel` over the checkpoint at ``--speculative-draft-model-path``."""

    hidden_layers = ()

    def __init__(self, ctx: SpeculativeContext) -> None:
        module, config = load_module(ctx.draft_model_path, ctx)
        super().__init__(ctx, module, config)
