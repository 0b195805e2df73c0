"""The scheduler's side of speculative decoding: one verify step per decode step.

:class:`SpecDecoder` replaces the plain decode step when ``--speculative-algorithm`` is
set. Per step, for the running requests:

1. reserve KV slots for each request's root (its last token) and up to
   ``num_draft_tokens - 1`` draft tokens (fewer near ``max_new_tokens``, the context end or
   a full pool; none while more than ``--speculative-disable-by-batch-size`` requests
   decode) and write them into the request-to-token table;
2. ask the proposer for drafts; an exception costs the step its drafts, nothing else;
3. run one target forward: plain decode when no request has a draft, else target verify
   over every request's tree (a request without a draft is a one-node tree);
4. accept (:mod:`radixserve.speculative.verify`) over the target's processed logits per
   node: penalties along the node's path, the grammar mask at the node (matchers advance
   over the path and roll back), temperature and filters;
5. move accepted tree nodes' K/V onto their path's slots, emit the accepted tokens one by
   one through the usual finish checks (EOS, stop tokens and strings, grammar end,
   ``max_new_tokens``: the run is cut at the first finish), return the slots of rejected
   tokens to the pool, and report the step to the proposer.

Only computed, accepted tokens ever count as cached (``kv_len``), so the prefix cache never
holds a rejected token's K/V.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import torch

from radixserve.distributed import replicated_scope
from radixserve.distributed.step_sync import gather_embedding
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.options import options_for
from radixserve.sampling.bitmask import allocate_token_bitmask
from radixserve.speculative import Proposer, SpeculativeContext, TargetModel, TargetStep
from radixserve.speculative.draft_loading import CoreHandles
from radixserve.speculative.tree import Draft, DraftError, path_tokens, validate
from radixserve.speculative.verify import Acceptance, accept_greedy, accept_sampled

if TYPE_CHECKING:
    from radixserve.engine.request import Req

logger = logging.getLogger(__name__)

DEFAULT_NUM_STEPS = 3
DEFAULT_TOPK = 1


def resolve_speculative_args(args, entry, target=None) -> dict:
    """The effective ``--speculative-*`` knobs: the flag, else the method's default (its
    registration's ``defaults``; a callable one is called with the target's ModelRunner and
    may return None for the core's), else the core's."""
    defaults = dict(entry.extra.get("defaults", {}))

    def pick(name, core_default):
        value = getattr(args, name)
        if value is not None:
            return value
        value = defaults.get(name, core_default)
        if callable(value):
            if target is None:
                raise ValueError(f"the default of --{name.replace('_', '-')} needs the target model")
            value = value(target)
        return core_default if value is None else value

    steps = pick("speculative_num_steps", DEFAULT_NUM_STEPS)
    topk = pick("speculative_eagle_topk", DEFAULT_TOPK)
    return {
        "num_steps": steps,
        "eagle_topk": topk,
        "num_draft_tokens": pick("speculative_num_draft_tokens", steps * topk + 1),
        "disable_by_batch_size": pick("speculative_disable_by_batch_size", None),
    }


def build_proposer(args, registry, runner, tokenizer, eos_token_ids) -> tuple[Proposer, dict] | None:
    """The proposer chosen by ``--speculative-algorithm`` (None when unset) and its knobs.
    Refuses an attention backend without target-verify support."""
    if args.speculative_algorithm is None:
        return None
    name = args.speculative_algorithm.lower()
    entry = registry.resolve("speculative", name, flag="--speculative-algorithm")
    backend = runner.attn_backend
    if not backend.supports_target_verify:
        raise ValueError(
            f"{args.backend_flag('prefill')} {args.prefill_backend_name}: this attention backend does not "
            f"implement target verify (an extend over a draft tree), which --speculative-algorithm "
            f"{args.speculative_algorithm} needs; use one that does (torch_native, triton) or drop "
            f"--speculative-algorithm")
    target = TargetModel(device=runner.device, dtype=runner.dtype, context_len=runner.context_len,
                         max_running_requests=runner.max_running_requests, page_size=args.page_size,
                         embed_tokens=getattr(runner.model, "embed_tokens", None), kv_pool=runner.kv_pool,
                         req_to_token_pool=runner.req_to_token_pool, embedding_table=gather_embedding(runner))
    knobs = resolve_speculative_args(args, entry, target)
    ctx = SpeculativeContext(
        algorithm=name, model_config=runner.model_config, target=target, tokenizer=tokenizer,
        eos_token_ids=frozenset(eos_token_ids), vocab_size=runner.model_config.vocab_size,
        num_draft_tokens=knobs["num_draft_tokens"], num_steps=knobs["num_steps"], eagle_topk=knobs["eagle_topk"],
        draft_model_path=args.speculative_draft_model_path,
        draft_model_quantization=args.speculative_draft_model_quantization,
        options=options_for(args, entry), core=CoreHandles(args, registry))
    with replicated_scope():  # a draft model is whole on rank 0 and runs there alone (DraftModel.forward)
        proposer = entry.factory(ctx)
    if not isinstance(proposer, Proposer):
        raise TypeError(f"--speculative-algorithm {name}: the factory from {entry.distribution} returned "
                        f"{type(proposer).__name__}, not a radixserve.speculative.Proposer")
    return proposer, knobs


class SpecStats:
    def __init__(self, max_tokens: int) -> None:
        self.num_verify_steps = 0  # decode steps that verified at least one draft
        self.num_draft_tokens = 0  # draft tokens proposed (and verified)
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_proposer_errors = 0
        self.accept_length_hist: Counter[int] = Counter()  # tokens emitted per request-step
        # request-steps that verified a draft (a step without one decodes a single token) and
        # the tokens they emitted
        self.num_drafted_steps = 0
        self.num_drafted_emitted = 0

    def as_dict(self) -> dict:
        steps = sum(self.accept_length_hist.values())
        emitted = sum(k * v for k, v in self.accept_length_hist.items())
        return {
            "spec_num_verify_steps": self.num_verify_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "spec_accept_length": emitted / steps if steps else 0.0,
            "spec_accept_length_hist": dict(sorted(self.accept_length_hist.items())),
            "spec_num_drafted_steps": self.num_drafted_steps,
            "spec_num_drafted_emitted": self.num_drafted_emitted,
            "spec_drafted_accept_length": (self.num_drafted_emitted / self.num_drafted_steps
                                           if self.num_drafted_steps else 0.0),
            "spec_num_proposer_errors": self.num_proposer_errors,
        }


class SpecDecoder:
    """The speculative decode driver: ``run(reqs, failed)`` as the plain decode step, over
    the scheduler's parts (KV manager, output processor, isolated forward, counters)."""

    def __init__(self, proposer: tuple[Proposer, dict] | Proposer, runner, kv, outputs, forward,
                 sched_stats) -> None:
        if isinstance(proposer, tuple):
            proposer, knobs = proposer
        else:
            knobs = {"num_draft_tokens": 4, "disable_by_batch_size": None}
        self.proposer = proposer
        self.num_draft_tokens = knobs["num_draft_tokens"]
        self.disable_by_batch_size = knobs["disable_by_batch_size"]
        self.stats = SpecStats(self.num_draft_tokens)
        self.runner, self.kv, self.outputs, self.forward = runner, kv, outputs, forward
        self.sched_stats = sched_stats
        self.runner.capture_hidden_layers = tuple(proposer.hidden_layers)

    # ------------------------------------------------------------ proposer calls
    def release(self, req: Req) -> None:
        try:
            self.proposer.release(req)
        except Exception:  # noqa: BLE001 - a proposer bug must not fail the request
            logger.exception("speculative proposer: release(%s) raised", req.rid)

    def _observe(self, steps: list[TargetStep]) -> None:
        if not steps:
            return
        try:
            self.proposer.observe(steps)
        except Exception:  # noqa: BLE001
            self.stats.num_proposer_errors += 1
            logger.exception("speculative proposer: observe() raised")

    def observe_received(self, req: Req, num: int) -> None:
        """``req``'s first ``num`` positions got their K/V from another server (prefill-decode
        disaggregation): no hidden states, so only proposers that need none are used there."""
        self._observe([TargetStep(req, 0, num, None)])

    def observe_extend(self, plan: list[tuple[Req, int]], batch: ForwardBatch | None) -> None:
        """Report an extend step's computed chunks (with hidden states when asked for)."""
        if batch is None:
            return
        hidden = batch.extra.get("aux_hidden")
        start_of, offset = {}, 0
        for r, n in zip(batch.extra["reqs"], batch.extend_lens_cpu):
            start_of[id(r)] = offset
            offset += n
        steps = []
        for req, n in plan:
            if req.finished:
                continue
            row = start_of[id(req)]
            steps.append(TargetStep(req, req.kv_len - n, n, None if hidden is None else hidden[row:row + n]))
        self._observe(steps)

    def _propose(self, reqs: list[Req], limits: list[int]) -> list[Draft | None]:
        asked = [i for i, k in enumerate(limits) if k > 0]
        drafts: list[Draft | None] = [None] * len(reqs)
        if not asked:
            return drafts
        try:
            got = self.proposer.propose([reqs[i] for i in asked], [limits[i] for i in asked])
            if len(got) != len(asked):
                raise DraftError(f"propose() returned {len(got)} drafts for {len(asked)} requests")
        except Exception:  # noqa: BLE001 - the step goes on without drafts
            self.stats.num_proposer_errors += 1
            logger.exception("speculative proposer: propose() raised; decoding without drafts this step")
            return drafts
        vocab = self.outputs.vocab_size
        for i, d in zip(asked, got):
            if d is None or not len(d.tokens):
                continue
            try:
                drafts[i] = validate(d, vocab, limits[i])
            except DraftError as e:
                self.stats.num_proposer_errors += 1
                logger.error("speculative proposer: bad draft for request %s: %s", reqs[i].rid, e)
        return drafts

    # ------------------------------------------------------------ the step
    def _limits(self, reqs: list[Req]) -> list[int]:
        """Most draft tokens per request this step, with KV pages reserved for them."""
        if self.disable_by_batch_size is not None and len(reqs) > self.disable_by_batch_size:
            return [0] * len(reqs)
        limits = []
        for req in reqs:
            k = min(self.num_draft_tokens - 1,
                    req.max_new_tokens - len(req.output_ids) - 1,  # the bonus token is one more
                    self.runner.context_len - req.seq_len - 1)
            limits.append(self.kv.grow_for_drafts(req, k) if k > 0 else 0)
        return limits

    def run(self, reqs: list[Req], failed: list[Req]) -> tuple[list[Req], list[Req]]:
        """One decode step of ``reqs`` with speculation. Returns (requests that ran, those
        that finished or failed while taking their tokens)."""
        limits = self._limits(reqs)
        drafts = self._propose(reqs, limits)
        if any(d is not None for d in drafts):
            trees = []
            for req, d in zip(reqs, drafts):
                if d is None:
                    trees.append(([-1], [req.all_ids[-1]]))
                else:
                    trees.append((d.node_parents(), [req.all_ids[-1]] + list(d.tokens)))
            ran, trees, logits, batch = self.forward(reqs, ForwardMode.TARGET_VERIFY, trees, failed,
                                                     build=self.runner.build_verify_batch)
        else:
            ran, _, logits, batch = self.forward(reqs, ForwardMode.DECODE, None, failed)
            trees = [([-1], [r.all_ids[-1]]) for r in ran]
        finished: list[Req] = []
        if ran:
            finished = self._accept_and_emit(ran, trees, logits, batch)
        for req in reqs:  # rejected tokens' pages go back (finished requests hold none)
            if not req.finished:
                self.kv.trim(req)
        return ran, finished

    def _row_spans(self, ran: list[Req], batch: ForwardBatch, logits: torch.Tensor) -> list[int]:
        """First logits row of each request that ran."""
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            return list(range(len(ran)))
        offsets, off = {}, 0
        for r, n in zip(batch.extra["reqs"], batch.extend_lens_cpu):
            offsets[id(r)] = off
            off += n
        return [offsets[id(r)] for r in ran]

    def _accept_and_emit(self, ran, trees, logits, batch) -> list[Req]:
        out = self.outputs
        starts = self._row_spans(ran, batch, logits)
        errors: dict[int, str] = {}
        accepted = self._accept(ran, trees, logits, starts, errors)
        hidden = batch.extra.get("aux_hidden")
        finished: list[Req] = []
        steps: list[TargetStep] = []
        moves_src, moves_dst = [], []
        for i, req in enumerate(ran):
            if i in errors:
                out.fail(req, errors[i], finished)
                continue
            acc: Acceptance = accepted[i]
            parents, tokens = trees[i]
            root = req.seq_len - 1
            drafted = len(tokens) - 1
            if drafted:
                self.stats.num_draft_tokens += drafted
                self.stats.num_accepted_tokens += len(acc.nodes)
            for depth, node in enumerate(acc.nodes, start=1):
                if node != depth:  # a side branch: its K/V moves onto the path's slots
                    moves_src.append(self.kv.slot_of(req, root + node))
                    moves_dst.append(self.kv.slot_of(req, root + depth))
            try:
                reason, emitted = self._emit(req, acc, logits, starts[i])
            except Exception as e:  # noqa: BLE001 - ends this request only
                logger.exception("request %s failed while taking its accepted tokens", req.rid)
                out.fail(req, f"{type(e).__name__}: {e}", finished)
                continue
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += min(emitted, len(acc.nodes))
            self.stats.accept_length_hist[emitted] += 1
            if drafted:
                self.stats.num_drafted_steps += 1
                self.stats.num_drafted_emitted += emitted
            self.sched_stats.num_decode_tokens += emitted
            # K/V valid: the root and the accepted nodes whose tokens were emitted
            req.kv_len = root + 1 + min(emitted, len(acc.nodes))
            if reason is not None:
                out.finish(req, reason, notify=False)
                finished.append(req)
                continue
            if not out.notify(req, emitted, False):
                out.fail(req, "its output callback raised", finished)
                continue
            if hidden is not None:
                rows = [starts[i] + n for n in [0] + acc.nodes]
                h = hidden[rows]
            else:
                h = None
            steps.append(TargetStep(req, root, 1 + len(acc.nodes), h, len(acc.nodes) if drafted else None))
        if moves_src:  # before anything reads those slots again
            dev = self.runner.kv_pool.device
            self.runner.move_kv(torch.tensor(moves_src, device=dev), torch.tensor(moves_dst, device=dev))
        if any(len(t[1]) > 1 for t in trees):
            self.stats.num_verify_steps += 1
        self._observe(steps)
        return finished

    def _emit(self, req: Req, acc: Acceptance, logits: torch.Tensor, start: int) -> tuple[dict | None, int]:
        """Append the accepted tokens one by one; stop at the first finish."""
        for k, tok in enumerate(acc.tokens):
            req.output_ids.append(tok)
            if req.params.return_logprob:
                self._logprob(req, logits, start + acc.rows[k], tok)
            reason = self.outputs.finish_reason(req, tok)
            if reason is not None:
                return reason, k + 1
        return None, len(acc.tokens)

    def _logprob(self, req: Req, logits: torch.Tensor, row: int, tok: int) -> None:
        lp = self._processed_rows.get((id(req), row))
        if lp is None:
            lp = torch.log_softmax(logits[row].float(), dim=-1)
        req.output_token_logprobs.append(float(lp[tok]))
        n = req.params.top_logprobs_num
        if n:
            values, ids = lp.topk(n)
            req.output_top_logprobs.append((ids.tolist(), values.tolist()))

    # ------------------------------------------------------------ acceptance
    def _node_rows(self, ran, trees, starts):
        """Per tree node of every request: (request index, logits row, path tokens)."""
        out = []
        for i, (_req, (parents, tokens)) in enumerate(zip(ran, trees)):
            for node in range(len(tokens)):
                out.append((i, starts[i] + node, path_tokens(parents, tokens, node)))
        return out

    def _accept(self, ran, trees, logits, starts, errors) -> list[Acceptance | None]:
        """Acceptance of every request, batched; if the batch raises, request by request
        (a request that still raises is recorded in ``errors``)."""
        self._processed_rows = {}
        try:
            return self._accept_rows(list(range(len(ran))), ran, trees, logits, starts, errors)
        except Exception:  # noqa: BLE001
            logger.exception("speculative acceptance of a batch of %d failed; retrying one by one", len(ran))
        out: list[Acceptance | None] = [None] * len(ran)
        for i in range(len(ran)):
            if i in errors:
                continue
            try:
                out[i] = self._accept_rows([i], ran, trees, logits, starts, errors)[i]
            except Exception as e:  # noqa: BLE001
                logger.exception("request %s: speculative acceptance failed", ran[i].rid)
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
        return out

    def _accept_rows(self, which, ran, trees, logits, starts, errors) -> list[Acceptance | None]:
        sampler = self.outputs.sampler
        nodes = [n for n in self._node_rows(ran, trees, starts) if n[0] in which]
        reqs = [ran[i] for i, _, _ in nodes]
        histories = [(r.input_ids, r.output_ids + path) for r, (_, _, path) in zip(reqs, nodes)]
        counts = [len(r.output_ids) + len(path) for r, (_, _, path) in zip(reqs, nodes)]
        info = self.outputs.sampling_info(reqs, logits.device, histories=histories, counts=counts)
        if any(r.grammar is not None for r in reqs):
            info.vocab_mask = self._tree_masks(nodes, ran, trees, errors)
        rows = torch.tensor([row for _, row, _ in nodes], device=logits.device)
        processed = sampler.process(logits[rows], info)  # [N, V]
        argmax = processed.argmax(dim=-1).tolist()
        probs = None if info.is_all_greedy else sampler.probs(processed, info)
        need_lp = any(r.params.return_logprob for r in reqs)
        lps = torch.log_softmax(processed, dim=-1) if need_lp else None
        out: list[Acceptance | None] = [None] * len(ran)
        first = {}
        for k, (i, row, _) in enumerate(nodes):
            first.setdefault(i, k)
            if lps is not None and ran[i].params.return_logprob:
                self._processed_rows[(id(ran[i]), row)] = lps[k]
        for i in which:
            if i in errors:
                continue
            parents, tokens = trees[i]
            k0 = first[i]
            req = ran[i]
            if req.params.is_greedy:
                out[i] = accept_greedy(parents, tokens, argmax[k0:k0 + len(tokens)])
            else:
                out[i] = accept_sampled(parents, tokens, probs[k0:k0 + len(tokens)], req.generator)
        return out

    def _tree_masks(self, nodes, ran, trees, errors) -> torch.Tensor:
        """Grammar bitmask rows for every node: a constrained request's matcher advances
        over the node's path, fills the row and rolls back. A node whose path the grammar
        rejects can never be accepted (its parent's mask gives it probability 0): its row
        allows everything."""
        mask = allocate_token_bitmask(len(nodes), self.outputs.vocab_size)  # all allowed
        for k, (i, _, path) in enumerate(nodes):
            matcher = ran[i].grammar
            if matcher is None or i in errors:
                continue
            accepted = 0
            try:
                for tok in path:
                    if not matcher.accept_token(tok):
                        break
                    accepted += 1
                if accepted == len(path):
                    matcher.fill_bitmask(mask, k)
            except Exception as e:  # noqa: BLE001 - a matcher bug ends its request only
                logger.exception("request %s: the grammar matcher failed on a draft path", ran[i].rid)
                errors[i] = f"the grammar backend failed: {type(e).__name__}: {e}"
                mask[k].fill_(-1)
            finally:
                if accepted:
                    try:
                        matcher.rollback(accepted)
                    except Exception as e:  # noqa: BLE001
                        logger.exception("request %s: the grammar matcher failed to roll back", ran[i].rid)
                        errors[i] = f"the grammar backend failed to roll back: {type(e).__name__}: {e}"
        return mask

    def get_stats(self) -> dict:
        out = self.stats.as_dict()
        try:
            out.update({f"spec_{k}": v for k, v in self.proposer.stats().items()})
        except Exception:  # noqa: BLE001
            logger.exception("speculative proposer: stats() raised")
        return out
