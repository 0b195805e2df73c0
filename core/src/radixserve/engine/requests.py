"""Turning a caller's prompts and sampling parameters into scheduler requests, and a finished
request into the output dict ``generate`` returns (SGLang's ``text``, ``output_ids``,
``meta_info``). A part of :class:`~radixserve.engine.engine.Engine`."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import torch

from radixserve.config.limits import MAX_CACHE_SALT
from radixserve.engine.hidden_states import hidden_states_answer
from radixserve.engine.priority import PriorityRejected, resolve_priority
from radixserve.engine.request import Req
from radixserve.engine.scheduler import RequestRejected
from radixserve.grammar import check_constraint_size
from radixserve.sampling import InvalidSamplingParams, SamplingParams
from radixserve.sampling.limits import check_fields, check_prompt_work

PromptT = str | list[str] | None
IdsT = list[int] | list[list[int]] | None


def prompt_logprob_entries(
        req: Req) -> tuple[list[tuple[float | None, int]], list[tuple[list[int], list[float]] | None]]:
    """The prompt logprobs of ``req`` from ``logprob_start_len`` on, as SGLang reports them:
    ``(logprob, token id)`` per prompt token (logprob None for token 0, which nothing
    predicts), and the top (ids, logprobs) per position (None for token 0; empty when
    ``top_logprobs_num`` is 0)."""
    start = req.params.logprob_start_len
    lps: list[float | None] = list(req.input_token_logprobs)
    tops: list = list(req.input_top_logprobs)
    if start == 0:
        lps.insert(0, None)
        tops.insert(0, None)
    ids = req.input_ids[start:start + len(lps)]
    return list(zip(lps, ids, strict=True)), tops


def set_bootstrap(reqs: list[Req], host: str | None, port: int | None, room: int | None) -> None:
    """SGLang's ``bootstrap_*`` arguments (prefill-decode disaggregation) onto ``reqs``; a room
    carries one sequence (RequestRejected for several prompts or ``n > 1``)."""
    if room is not None:
        if len(reqs) != 1:
            raise RequestRejected(f"a bootstrap room carries one sequence, got {len(reqs)} (several prompts or "
                                  "n > 1): send them as separate requests", "n")
        for r in reqs:
            r.bootstrap = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


class RequestBuilding:
    """The Engine's request side; it reads ``tokenizer``, ``model_config``, ``server_args``,
    ``sampling_defaults``, ``runner``, ``scheduler`` and ``_seed_counter`` of the engine."""

    def _collect(self, reqs: list[Req], single: bool):
        outs = [self._output(r) for r in reqs]
        return outs[0] if single and len(outs) == 1 else outs

    def normalize(self, prompt: PromptT, input_ids: IdsT,
                  sampling_params) -> tuple[list[list[int]], list[SamplingParams], bool]:
        """Validate a request: (token id lists, verified SamplingParams, whether it was one prompt).

        Sampling parameters given as a dict (or None) get ``self.sampling_defaults`` for the
        fields they leave out (``--sampling-defaults``, ``--preferred-sampling-params``); a
        SamplingParams object is used as given."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
            vocab = self.model_config.vocab_size
            for seq in ids:
                if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in seq):
                    raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            plist = sampling_params
        else:
            plist = [sampling_params] * len(ids)
        params = []
        for p in plist:  # a dict (or None) gets the sampling defaults for what it leaves out
            if p is None:
                p = SamplingParams.from_dict(dict(self.sampling_defaults))
            elif isinstance(p, dict):
                p = SamplingParams.from_dict({**self.sampling_defaults, **p})
            p.verify(self.model_config.vocab_size)
            check_fields(p, self.server_args)
            params.append(p)
        return ids, params, single

    @staticmethod
    def _priorities(priority, count: int) -> list | None:
        """``generate``'s ``priority`` (one for all prompts, or a list) as one per prompt."""
        if priority is None or not isinstance(priority, list):
            return None if priority is None else [priority] * count
        if len(priority) != count:
            raise RequestRejected(f"priority: {len(priority)} priorities for {count} prompts", "priority")
        return priority

    def _adapters(self, lora_path, count: int) -> list:
        """``lora_path`` as one loaded adapter (or None) per prompt; a 400 naming the field when it
        names no loaded adapter or LoRA is off."""
        paths = lora_path if isinstance(lora_path, list) else [lora_path] * count
        if len(paths) != count:
            raise RequestRejected(f"lora_path: {len(paths)} adapters for {count} prompts", "lora_path")
        manager = getattr(self.runner, "lora", None)
        out = []
        for name in paths:
            if name is None:
                out.append(None)
                continue
            if manager is None:
                raise RequestRejected(f"lora_path {name!r}: this server serves no LoRA adapters (start it with "
                                      "--enable-lora / --lora-paths)", "lora_path")
            adapter = manager.get(name) if isinstance(name, str) else None
            if adapter is None:
                raise RequestRejected(f"lora_path: unknown adapter {name!r}; loaded: "
                                      f"{', '.join(manager.adapters) or 'none'}", "lora_path")
            out.append(adapter)
        return out

    def make_requests(self, ids: list[list[int]], params: list[SamplingParams],
                      rids: list[str] | None = None, priorities: list | None = None,
                      cache_salt: str | None = None, lora_path=None) -> list[list[Req]]:
        """One group of ``n`` requests per prompt (ids and params already validated).

        ``rids`` names the groups (a group of n > 1 gets ``rid-0`` ... ``rid-{n-1}``);
        fresh ids otherwise. ``priorities``: one per prompt (None: the default). ``cache_salt``:
        the requests' prefix-cache namespace (None: the shared one; see ``Req.cache_ids``). Raises
        RequestRejected when a prompt can never fit, or its priority cannot be used. ``lora_path``:
        a loaded adapter's name for every prompt, or a list of one name (or None) per prompt.
        """
        adapters = self._adapters(lora_path, len(ids))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT):
            raise RequestRejected(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                                  "cache_salt")
        try:
            check_prompt_work(sum(len(seq) * p.n for seq, p in zip(ids, params)), self.server_args)
        except InvalidSamplingParams as e:
            raise RequestRejected(str(e), e.param) from None
        groups = []
        for k, (seq, p) in enumerate(zip(ids, params)):
            try:
                priority = resolve_priority(self.server_args, priorities[k] if priorities else None)
            except PriorityRejected as e:
                raise RequestRejected(str(e), e.param) from None
            max_new = p.max_new_tokens if p.max_new_tokens is not None else self.runner.context_len - len(seq)
            self.scheduler.check_fits(len(seq), max_new)
            check_constraint_size(p, self.server_args.grammar_max_spec_bytes)
            if p.return_hidden_states and self.scheduler.spec is not None:
                raise RequestRejected("return_hidden_states is not supported with speculative decoding "
                                      "(--speculative-algorithm)", "return_hidden_states")
            if p.wants_prompt_logprobs and p.logprob_start_len >= len(seq):
                raise RequestRejected(f"logprob_start_len ({p.logprob_start_len}) must be below the prompt length "
                                      f"({len(seq)} tokens)", "logprob_start_len")
            group = []
            base = rids[k] if rids is not None else uuid.uuid4().hex
            # n > 1 with prompt logprobs: the first sequence computes them, the others report
            # its answer and take the prompt from the prefix cache like any shared prefix
            sibling_p = dataclasses.replace(p, logprob_start_len=-1) if p.wants_prompt_logprobs else p
            for i in range(p.n):
                gen = None
                seed = p.seed + i if p.seed is not None else (
                    None if self.server_args.random_seed is None
                    else self.server_args.random_seed + next(self._seed_counter))
                if seed is not None:
                    gen = torch.Generator(device=self.runner.device).manual_seed(seed)
                req = Req(f"{base}-{i}" if p.n > 1 else base, list(seq), sibling_p if i else p, max_new,
                          generator=gen, priority=priority, cache_salt=cache_salt)
                if adapters[k] is not None:
                    req.lora_name, req.lora_key = adapters[k].name, adapters[k].key
                if i and sibling_p is not p:
                    req.prompt_logprobs_from = group[0]
                group.append(req)
            groups.append(group)
        return groups

    def _output(self, req: Req) -> dict[str, Any]:
        p = req.params
        text = req.stop_text if req.stop_text is not None else self.tokenizer.decode(
            req.output_ids, skip_special_tokens=p.skip_special_tokens)
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if self.scheduler.spec is not None:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = req.spec_accept_length
        if p.return_logprob:
            meta["output_token_logprobs"] = [(lp, t) for lp, t in zip(req.output_token_logprobs, req.output_ids)]
            if p.top_logprobs_num:
                meta["output_top_logprobs"] = [list(zip(lps, tids)) for tids, lps in req.output_top_logprobs]
        source = req.prompt_logprobs_from or req
        if source.params.wants_prompt_logprobs:
            tokens, tops = prompt_logprob_entries(source)
            meta["input_token_logprobs"] = tokens
            if p.top_logprobs_num:
                meta["input_top_logprobs"] = [None if t is None else list(zip(t[1], t[0])) for t in tops]
        if p.return_hidden_states:
            meta["hidden_states"] = hidden_states_answer(req.hidden_states, p.return_hidden_states)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
