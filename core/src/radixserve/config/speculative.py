"""Engine flags: speculative decoding's method, its draft model and its draft sizes (a
method's own flags, such as NGRAM's, are declared by its plugin)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag
from radixserve.flags import ConfigError


@dataclass
class SpeculativeArgs(Checks):
    speculative_algorithm: str | None = flag(
        None,
        "speculative decoding method (case-insensitive: NGRAM, STANDALONE, EAGLE3 / EAGLE, ...; see "
        "`radixserve plugins`)",
    )
    speculative_draft_model_path: str | None = flag(
        None,
        "draft model (STANDALONE: a smaller model with the same tokenizer; EAGLE3: the draft head "
        "checkpoint)",
    )
    speculative_draft_model_quantization: str | None = flag(
        None,
        "how the draft model's (or EAGLE3 head's) linear layers store their weights, the choices of "
        "--quantization; default: the method's (EAGLE3 on CPU: w8a16_int8), else gguf for a .gguf "
        "draft and none (its --dtype weights) otherwise",
    )
    speculative_num_steps: int | None = flag(
        None,
        "draft depth of a model proposer (default: the method's, 3 for model drafts)",
    )
    speculative_eagle_topk: int | None = flag(
        None,
        "branching of a model proposer's draft tree per step (1: a chain)",
    )
    speculative_num_draft_tokens: int | None = flag(
        None,
        "most tokens verified per request and step, its last token included (default: the method's)",
    )
    speculative_disable_by_batch_size: int | None = flag(
        None,
        "decode without speculation while more than this many requests decode (default: the method's,"
        " from the CPU benchmark)",
    )

    def check_speculative(self) -> None:
        for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                     "speculative_disable_by_batch_size"):
            self._check_int(name, minimum=1, optional=True)
        if self.speculative_num_draft_tokens == 1:
            raise ConfigError("--speculative-num-draft-tokens must be >= 2 (the request's last token plus "
                              "at least one draft token), got 1")
        self._check_name("speculative_algorithm", "a method name")
