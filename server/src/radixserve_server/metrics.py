"""Prometheus metrics (prometheus_client, one registry per server).

Latency histograms and token counters are observed in the HTTP process as tokens
arrive; queue, memory and cache gauges are read from the engine at scrape time, and so are
the speculative-decoding gauges, which exist only once the engine reports them (a server
started with ``--speculative-algorithm``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "radixserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

# engine stats key -> (gauge name, help)
_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "Requests admitted to the running batch"),
    "num_waiting_reqs": ("num_queue_reqs", "Requests waiting in the scheduler's queue"),
    "token_usage": ("token_usage", "Fraction of the KV pool held by running requests and the cache"),
    "num_used_tokens": ("num_used_tokens", "KV slots in use"),
    "max_total_num_tokens": ("max_total_num_tokens", "KV pool size in tokens"),
    "cache_hit_rate": ("cache_hit_rate", "Prompt tokens served from the prefix cache / all prompt tokens"),
    "num_cached_tokens": ("num_cached_tokens", "Tokens held by the prefix cache"),
    "num_preemptions": ("num_preemptions", "Running requests preempted by a more urgent one since launch "
                        "(--enable-priority-scheduling)"),
    "num_grammar_queue_reqs": ("num_grammar_queue_reqs", "Requests waiting for their grammar to compile"),
    "num_disagg_waiting_reqs": ("num_decode_transfer_queue_reqs", "Decode server (prefill-decode disaggregation): "
                                "requests waiting for pages or for their KV from the prefill server"),
    "num_disagg_sending_reqs": ("num_prefill_inflight_queue_reqs", "Prefill server (prefill-decode "
                                "disaggregation): prefilled requests holding their pages until their KV is sent"),
    "num_grammar_compiles_killed": ("num_grammar_compiles_killed", "Grammar compiles stopped at "
                                    "--grammar-compile-timeout (their worker process killed) since launch"),
    "num_grammar_compiles_refused": ("num_grammar_compiles_refused", "Grammar compiles refused with a 429 "
                                     "(too many waiting, in all or for one client) since launch"),
}

# --dp-size: the router's numbers per replica, besides each replica's _GAUGES
_DP_GAUGES = {
    "num_in_flight": ("num_in_flight", "Sequences this server has in flight on the replica"),
    "num_routed": ("num_routed", "Sequences the router sent to the replica since launch"),
    "num_prompt_tokens": ("num_prompt_tokens", "Prompt tokens the replica has seen"),
    "num_cached_prompt_tokens": ("num_cached_prompt_tokens", "Prompt tokens the replica served from its prefix cache"),
    "tree_size": ("router_tree_size", "Token ids the cache-aware router remembers for the replica"),
    "alive": ("alive", "1 while the replica's engine process runs"),
}

# speculative decoding: engine stats key -> (gauge name, help); the engine's running totals
# are exported as gauges, like the rest of its stats, since they are read, not counted, here
_SPEC_GAUGES = {
    "spec_accept_length": ("spec_accept_length", "Mean tokens emitted per request and verify step"),
    "spec_drafted_accept_length": ("spec_drafted_accept_length",
                                   "Mean tokens emitted per request and verify step that had a draft"),
    "spec_acceptance_rate": ("spec_acceptance_rate", "Accepted draft tokens / draft tokens verified"),
    "spec_num_verify_steps": ("spec_num_verify_steps", "Decode steps that verified drafts"),
    "spec_num_draft_tokens": ("spec_num_draft_tokens", "Draft tokens proposed and verified"),
    "spec_num_accepted_tokens": ("spec_num_accepted_tokens", "Draft tokens accepted"),
    "spec_num_proposer_errors": ("spec_num_proposer_errors",
                                 "Proposer calls that raised (their requests decoded without drafts)"),
}
_SPEC_HIST = "spec_accept_length_hist"  # tokens emitted per request-step -> how many times

# HiCache (--enable-hierarchical-cache): per-tier numbers, engine stats key
# ``hicache_{tier}_{stat}`` -> gauge ``hicache_{name}{tier=...}``
_HICACHE_TIERS = ("device", "host", "storage")
_HICACHE_GAUGES = {
    "hit_tokens": ("hicache_hit_tokens", "Prompt tokens served from a KV cache tier (device, host, storage)"),
    "load_bytes": ("hicache_load_bytes", "Bytes loaded from a KV cache tier into the one above"),
    "load_seconds": ("hicache_load_seconds", "Total time spent loading from a KV cache tier"),
    "num_loads": ("hicache_num_loads", "Loads from a KV cache tier"),
    "backup_bytes": ("hicache_store_bytes", "Bytes written into a KV cache tier"),
    "store_bytes": ("hicache_store_bytes", None),
    "errors": ("hicache_errors", "Failed, corrupted or refused operations of a KV cache tier"),
}


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        r = self.registry
        self.gauges = {key: Gauge(PREFIX + name, doc, labels, registry=r) for key, (name, doc) in _GAUGES.items()}
        self.spec_gauges: dict[str, Gauge] | None = None  # made on the first stats that have them
        self.spec_hist: Gauge | None = None
        self.hicache_gauges: dict[str, Gauge] | None = None  # made on the first stats that have them
        self.moe_gauges: tuple[Gauge, Gauge] | None = None  # MoE models only, made on first stats
        self.dp_gauges: dict[str, Gauge] | None = None  # --dp-size > 1 only, made on first stats
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache", labels,
                                     registry=r)
        self.requests = Counter(PREFIX + "num_requests", "Finished requests by finish reason",
                                labels + ["finish_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens of one request",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency from arrival to last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_tokens(self, num: int, seconds_since_last: float | None) -> None:
        """``num`` tokens arrived together ``seconds_since_last`` after the previous ones
        (``None`` for a request's first tokens, which have no inter-token latency)."""
        if num <= 0:
            return
        self.generation_tokens.labels(self.model_name).inc(num)
        if seconds_since_last is None:
            return
        per = seconds_since_last / num
        for _ in range(num):
            self.itl.labels(self.model_name).observe(per)

    def observe_finished(self, prompt_tokens: int, cached_tokens: int, reason: str, e2e: float) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.cached_tokens.labels(m).inc(cached_tokens)
        self.requests.labels(m, reason).inc()
        self.e2e.labels(m).observe(e2e)

    def set_engine_stats(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.labels(self.model_name).set(float(stats[key]))
        if "spec_num_verify_steps" in stats:
            self._set_spec_stats(stats)
        if "hicache_host_hit_tokens" in stats:
            self._set_hicache_stats(stats)
        if "moe_expert_tokens" in stats:
            self._set_moe_stats(stats)
        if "dp_replicas" in stats:
            self._set_dp_stats(stats["dp_replicas"])

    def _set_dp_stats(self, replicas: list[dict]) -> None:
        """``--dp-size``: each replica's gauges (and the router's numbers for it), labelled ``dp_rank``."""
        if self.dp_gauges is None:
            self.dp_gauges = {key: Gauge(PREFIX + "dp_" + name, doc + " (per data-parallel replica)",
                                         ["model_name", "dp_rank"], registry=self.registry)
                              for key, (name, doc) in {**_GAUGES, **_DP_GAUGES}.items()}
        for r in replicas:
            rank = str(r["dp_rank"])
            for key, gauge in self.dp_gauges.items():
                if key in r:
                    gauge.labels(self.model_name, rank).set(float(r[key]))

    def _set_moe_stats(self, stats: dict) -> None:
        if self.moe_gauges is None:
            self.moe_gauges = (
                Gauge(PREFIX + "moe_expert_tokens", "Token-expert pairs routed to an expert since launch (MoE)",
                      ["model_name", "layer", "expert"], registry=self.registry),
                Gauge(PREFIX + "moe_expert_imbalance", "Most-loaded expert's pairs / mean pairs per expert (MoE)",
                      ["model_name", "layer"], registry=self.registry))
        tokens, imbalance = self.moe_gauges
        for layer, row in stats["moe_expert_tokens"].items():
            for expert, n in enumerate(row):
                tokens.labels(self.model_name, str(layer), str(expert)).set(float(n))
        for layer, value in stats.get("moe_expert_imbalance", {}).items():
            imbalance.labels(self.model_name, str(layer)).set(float(value))

    def _set_hicache_stats(self, stats: dict) -> None:
        if self.hicache_gauges is None:
            self.hicache_gauges = {}
            for name, doc in _HICACHE_GAUGES.values():
                if doc is not None:
                    self.hicache_gauges[name] = Gauge(PREFIX + name, doc, ["model_name", "tier"],
                                                      registry=self.registry)
        for tier in _HICACHE_TIERS:
            for stat, (name, _) in _HICACHE_GAUGES.items():
                key = f"hicache_{tier}_{stat}"
                if key in stats:
                    self.hicache_gauges[name].labels(self.model_name, tier).set(float(stats[key]))

    def _set_spec_stats(self, stats: dict) -> None:
        labels = ["model_name"]
        if self.spec_gauges is None:
            self.spec_gauges = {key: Gauge(PREFIX + name, doc, labels, registry=self.registry)
                                for key, (name, doc) in _SPEC_GAUGES.items()}
            self.spec_hist = Gauge(PREFIX + "spec_accept_length_count",
                                   "Request-steps that emitted accept_length tokens (speculative decoding)",
                                   labels + ["accept_length"], registry=self.registry)
        for key, gauge in self.spec_gauges.items():
            if key in stats:
                gauge.labels(self.model_name).set(float(stats[key]))
        for length, count in (stats.get(_SPEC_HIST) or {}).items():
            self.spec_hist.labels(self.model_name, str(length)).set(float(count))

    def render(self) -> bytes:
        return generate_latest(self.registry)
