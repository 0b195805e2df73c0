"""SGLang's request fields that radixserve accepts without acting on them, or only at their
default: one table, read by the request bodies (:mod:`.protocol`) and by the README's field
table (a test keeps the two in step, and checks that every field of the installed ``sglang``
package's request classes is known here or implemented).

A request may always send SGLang's fields: a *no-op* field is accepted with any value and
changes nothing (the reason says why nothing is lost); a *default-only* field is accepted
at its default (null, false, 0, an empty list or object, as SGLang's clients send them)
and refused with a 400 naming it and the reason when set, because acting on it needs
something this server does not have. Fields radixserve implements are declared on the
bodies themselves.
"""

from __future__ import annotations

from typing import Any

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # the constrained-decoding fields, one at most

NOOP: dict[str, str] = {
    "model": "on /generate, the model name SGLang's router adds; one server serves one model",
    "session_id": "an identity label shared by a session's requests; SGLang does not change the prompt for it either",
    "routing_key": "read by a router's routing-key policy; one server has nothing to route",
    "conversation_id": "a tracking label",
    "http_worker_ipc": "SGLang-internal (its multi-tokenizer mode)",
    "received_time": "SGLang-internal (set by its own entry points)",
    "external_trace_header": "no tracing exporter here",
    "custom_labels": "per-request metric labels; radixserve's metrics have none",
    "kv_hints": "hints for HiCache storage backends; none of radixserve's tiers reads them",
    "disagg_prefill_dp_rank": "prefill/decode disaggregation with data parallelism: no disaggregation mode yet",
    "return_cached_tokens_details": "usage already gives cached_tokens; there is no per-tier breakdown",
    "return_spec_tokens_details": "usage already gives spec_verify_ct and spec_accept_length",
    "task": "SGLang's label for a request's task type",
    "lora_id": "SGLang-internal (its tokenizer manager sets it from lora_path, which names the adapter here too)",
}

DEFAULT_ONLY: dict[str, str] = {
    "modalities": "only text output is supported (an OpenAI request may say [\"text\"])",
    "input_embeds": "embedding inputs are not supported; send text or input_ids",
    "image_data": "no multimodal model is served",
    "video_data": "no multimodal model is served",
    "audio_data": "no multimodal model is served",
    "mm_hashes": "no multimodal model is served",
    "mm_content_hashes": "no multimodal model is served",
    "use_audio_in_video": "no multimodal model is served",
    "video_config": "no multimodal model is served",
    "images_config": "no multimodal model is served",
    "mm_processor_kwargs": "no multimodal model is served",
    "max_dynamic_patch": "no multimodal model is served",
    "min_dynamic_patch": "no multimodal model is served",
    "image_max_dynamic_patch": "no multimodal model is served",
    "video_max_dynamic_patch": "no multimodal model is served",
    "need_wait_for_mm_inputs": "no multimodal model is served",
    "num_items_assigned": "no multimodal model is served",
    "encoder_urls": "no multimodal model is served",
    "custom_logit_processor": "custom logit processors (serialized Python) are not accepted by this server",
    "positional_embed_overrides": "embedding overrides are not supported",
    "token_ids_logprob": "logprobs of chosen token ids are not supported; use top_logprobs_num",
    "return_sampling_mask": "sampling masks are not returned",
    "sampling_logprobs_mode": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_output_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_top_logprobs_b64": "top logprobs come as nested lists only",
    "return_routed_experts": "routed experts are not captured per request (see the expert distribution recorder)",
    "routed_experts_start_len": "routed experts are not captured per request",
    "return_indexer_topk": "no sparse-attention indexer",
    "return_entropy": "entropy is not returned",
    "return_bytes": "SGLang-internal (image generation)",
    "background": "background responses belong to the Responses API, which is not served",
    "require_reasoning": "no hybrid-reasoning model switch",
    "max_thinking_tokens": "thinking budgets are not enforced",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "token_indices_to_pool": "pooled scoring is not supported",
    "watermark": "watermarking is not supported",
    "thinking": "no thinking-budget control",
    "return_token_ids": "token ids come from /generate (output_ids) or /tokenize",
    "return_prompt_token_ids": "token ids come from /generate or /tokenize",
    "return_meta_info": "SGLang's meta_info is returned by /generate",
    "return_input_ids_in_sglext": "token ids come from /generate or /tokenize",
    "return_output_ids_in_sglext": "token ids come from /generate (output_ids)",
    "input_ids": "a chat request takes messages; send token ids to /v1/completions or /generate",
}


# values besides the defaults that a default-only field may take because they ask for nothing more
ALSO_FINE: dict[str, list[Any]] = {"modalities": [["text"]]}


def is_default(value: Any) -> bool:
    """SGLang's defaults as its clients send them: null, false, 0, empty, or a list of those."""
    if value is None or value is False or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                            and value == 0):
        return True
    if isinstance(value, (list, tuple, dict, str)) and not value:
        return True
    return isinstance(value, list) and all(is_default(v) for v in value)


def extras_problem(extras: dict[str, Any] | None, prefix: str = "") -> tuple[str, str] | None:
    """``(param, message)`` for the first field of ``extras`` (fields a body does not
    declare) that cannot be taken here: one SGLang does not know either, or a default-only
    field that was set; None when every one is fine."""
    for name, value in (extras or {}).items():
        param = prefix + name
        if name in NOOP:
            continue
        if name in DEFAULT_ONLY:
            if is_default(value) or value in ALSO_FINE.get(name, ()):
                continue
            return param, f"{param}: {DEFAULT_ONLY[name]}; omit it or pass its default (null)"
        return param, f"{param}: this field is not supported by this server"
    return None
