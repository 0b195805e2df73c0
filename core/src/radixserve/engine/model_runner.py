"""ModelRunner: owns the device, the model weights, the KV pools and the attention backend.
It turns scheduled requests into one :class:`ForwardBatch`, runs the model and returns
logits. It never decides *what* runs; the scheduler does."""

from __future__ import annotations

import dataclasses
import logging

import torch

from radixserve.config import DEFAULT_ATTENTION_BACKEND, ConfigError, ServerArgs
from radixserve.distributed import get_parallel_state
from radixserve.distributed.context import ContextParallel
from radixserve.distributed.context import splits as context_splits
from radixserve.distributed.dp_attention import DPAttention
from radixserve.distributed.partition import partition_heads
from radixserve.distributed.pipeline import PipelineStage
from radixserve.engine import memory
from radixserve.engine.cuda_graph import CudaGraphRunner, GraphCapturer
from radixserve.engine.expert_distribution import ExpertDistributionRecorder
from radixserve.engine.graph_setup import build_graphs
from radixserve.engine.lora import setup_lora
from radixserve.engine.moe import setup_moe
from radixserve.engine.request import Req, trailing_decode_rows
from radixserve.engine.startup import check_mla_supported
from radixserve.engine.two_batch import TwoBatchOverlap
from radixserve.engine.verify_graph import VerifyTapeRunner
from radixserve.kernels import cpu as cpu_kernels
from radixserve.layers.attention import (
    AttentionBackend,
    AttentionContext,
    ForwardBatch,
    ForwardMode,
    HybridAttentionBackend,
    check_kv_dtype,
)
from radixserve.layers.moe import moe_layers
from radixserve.lora.backend import lora_step
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.model_loader import LoadedCheckpoint
from radixserve.options import options_for
from radixserve.quantization import make_quantization, model_weight_bytes, quantization_scope
from radixserve.registry import Registry
from radixserve.sampling.logprobs import prompt_logprobs
from radixserve.speculative import tree

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype for ``--kv-cache-dtype name`` (auto: the activation ``dtype``)."""
    if name == "auto":
        return dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype: invalid value {name!r}; choose from: auto, {', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The ``--kv-cache-dtype`` spelling of a storage dtype (float32 for a float32 pool)."""
    names = {v: k for k, v in (_DTYPES | _KV_DTYPES).items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def default_attention_backend(registry: Registry, device: torch.device) -> str:
    """``--attention-backend`` when not given: ``triton`` on a GPU where it is installed and
    usable (its decode captures in CUDA graphs), else ``torch_native``."""
    if device.type == "cuda":
        entry = registry.entries["attention"].get("triton")
        if entry is not None and entry.is_available:
            return "triton"
    return DEFAULT_ATTENTION_BACKEND


class ModelRunner:
    def __init__(self, args: ServerArgs, ckpt: LoadedCheckpoint, registry: Registry) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        # --dtype bfloat16 on CPU: the linear weights are stored bf16 for radixserve's kernel, which
        # multiplies in float32; activations stay float32 (bf16 activations are slow without native
        # bf16 arithmetic and change the greedy tokens far more than bf16 weights do)
        self.weight_dtype = self.dtype
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and cpu_kernels.load() is not None:
            self.dtype = torch.float32
        # --dtype auto on CPU: float32 activations, and a float16/bfloat16 checkpoint's weights stay
        # 16-bit (widened in registers, embedding rows on lookup); --dtype float32 widens them at load
        self.keep_16bit_weights = self.device.type == "cpu" and args.dtype == "auto"
        # the KV pool's storage dtype; attention reads it back into self.dtype
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype)
        cfg = ckpt.config
        self.model_config = cfg
        if cfg.is_mla:
            check_mla_supported(args, cfg.architecture)
        # this rank's attention heads (all of them on one rank); its KV pool and backend hold only these
        ps = get_parallel_state()
        self.heads = partition_heads(cfg.num_attention_heads, cfg.num_key_value_heads, ps.tp_size, ps.tp_rank)
        self.context_len = args.context_length or cfg.max_position_embeddings

        arch = registry.get("model", cfg.architecture, flag="model architecture (config.json 'architectures')")
        self.quantization = make_quantization(registry, args.quantization, ckpt.format, self.device, self.dtype,
                                              weight_dtype=self.weight_dtype,
                                              keep_16bit_weights=self.keep_16bit_weights)
        with torch.device("meta"), quantization_scope(self.quantization):
            model = arch.factory(cfg, max_positions=self.context_len)
        model = model.to_empty(device="cpu")
        model.load_weights(ckpt.weights(keep_gguf_blocks=self.quantization.keep_gguf_blocks))
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.finalize(self.dtype, self.device)
        # resident weight bytes as the linear methods keep them; a decode step reads every
        # weight except the embedding table (one row per token)
        self.num_layers = model.end - model.start  # this pipeline stage's layers (all of them with one stage)
        self.weight_bytes, embed_bytes = model_weight_bytes(model)
        self.decode_weight_bytes = self.weight_bytes - embed_bytes
        self.model = model

        self._init_memory()
        # MoE layers get their runner and transport; the recorder counts tokens per expert
        self.expert_load = setup_moe(model, registry, args, dtype=self.dtype, device=self.device,
                                     max_num_tokens=max(args.max_prefill_tokens, self.max_running_requests) + 64)
        self.expert_distribution: ExpertDistributionRecorder | None = None
        if self.expert_load is not None:
            first = moe_layers(model)[0][1]
            self.expert_distribution = ExpertDistributionRecorder(
                self.expert_load, num_experts=first.num_experts, top_k=first.top_k,
                mode=args.expert_distribution_recorder_mode, directory=args.expert_distribution_recorder_dir,
                buffer_size=args.expert_distribution_recorder_buffer_size)
        ctx = AttentionContext(
            num_heads=self.heads.num_heads, num_kv_heads=self.heads.num_kv_heads,
            head_dim=cfg.head_dim, num_layers=self.num_layers, dtype=self.dtype,
            device=self.device, page_size=args.page_size, max_context_len=self.context_len,
            max_batch_size=self.max_running_requests, kv_dtype=self.kv_dtype,
            v_head_dim=cfg.kv_lora_rank if cfg.is_mla else None)
        self.attn_backend = self._make_attention_backend(registry, ctx)
        # --pp-size > 1: this rank runs its stage of every step, micro-batch by micro-batch
        self.pipeline = PipelineStage(self, args.pp_max_micro_batch_size) if ps.pp_size > 1 else None
        # --attn-cp-size > 1: a long prefill's tokens split over the ranks, attention round the ring
        self.context = ContextParallel(self) if ps.cp_size > 1 else None
        # --enable-dp-attention: this rank runs its attention group's requests, MoE layers over all ranks
        self.dp_attention = DPAttention(self, [m for _, m in moe_layers(self.model)]) if ps.attn_dp_size > 1 else None
        # target layers whose hidden states every batch keeps (set for speculative proposers)
        self.capture_hidden_layers: tuple[int, ...] = ()
        # multi-rank rank 0: sends each step to the other ranks first (radixserve.distributed.step_sync)
        self.step_driver = None
        model.set_attention_backend(self.attn_backend)
        # --enable-two-batch-overlap: MoE steps as two interleaved micro-batches (engine/two_batch.py)
        self.two_batch = TwoBatchOverlap.create(self, lambda: self._make_attention_backend(registry, ctx))
        self.lora = setup_lora(self, registry)  # --enable-lora: adapters over the targeted linear layers
        # captured decode graphs (init_cuda_graphs, once the engine is assembled); None: eager
        self.graph_runner: CudaGraphRunner | None = None
        self.verify_tapes: VerifyTapeRunner | None = None  # speculative verify steps on CPU (verify_graph.py)

    # --------------------------------------------------------------- set-up
    def _make_attention_backend(self, registry: Registry, ctx: AttentionContext) -> AttentionBackend:
        if self.args.attention_backend is None:
            self.args.attention_backend = default_attention_backend(registry, self.device)
        def make(phase: str, name: str) -> AttentionBackend:
            flag = self.args.backend_flag(phase)
            entry = registry.resolve("attention", name, flag=flag)
            backend = entry.factory(dataclasses.replace(ctx, options=options_for(self.args, entry)))
            check_kv_dtype(backend, ctx, f"{flag} {name}")
            if self.model_config.is_mla and not backend.supports_mla:
                can = [n for n, e in sorted(registry.kind_entries("attention").items())
                       if getattr(e.factory, "supports_mla", False)]
                raise ConfigError(f"{flag} {name}: this attention backend has no MLA (the latent attention of "
                                  f"{self.model_config.architecture}); choose one that has: {', '.join(can)}")
            return backend

        p_name, d_name = self.args.prefill_backend_name, self.args.decode_backend_name
        prefill = make("prefill", p_name)
        return prefill if d_name == p_name else HybridAttentionBackend(prefill, make("decode", d_name))

    def _init_memory(self) -> None:
        cfg, args = self.model_config, self.args
        page = args.page_size
        per_token = KVPool.bytes_per_token_for(self.num_layers, self.heads.num_kv_heads, cfg.head_dim,
                                              self.kv_dtype, v_in_k=cfg.is_mla)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:  # what is left after the weights (engine/memory.py)
            cuda = self.device.type == "cuda"
            fraction = args.mem_fraction_static or (memory.GPU_MEM_FRACTION if cuda else memory.CPU_MEM_FRACTION)
            free = memory.available_memory(self.device)
            budget = memory.kv_pool_budget(fraction, device_type=self.device.type,
                                           total=memory.total_memory(self.device), free=free)
            tokens = budget // per_token - page  # the scratch page 0 comes out of the budget too
            tokens = tokens if cuda else min(tokens, 1 << 18)
            memory.check_pool_size(tokens, context_len=self.context_len, per_token=per_token, budget=budget,
                                   free=free, fraction=fraction, weight_bytes=self.weight_bytes)
        ps = get_parallel_state()
        if ps.world_size > 1:  # ranks may hold different KV heads or layers, but one scheduler allocates for all
            least = torch.tensor([tokens])
            torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN, group=ps.cpu_group)
            tokens = int(least)
        num_pages = tokens // page + 1  # + the reserved scratch page 0
        self.max_total_tokens = (num_pages - 1) * page
        self.max_running_requests = args.max_running_requests or min(256, max(self.max_total_tokens // 16, 1))
        self.kv_pool = KVPool(num_layers=self.num_layers, num_pages=num_pages, page_size=page,
                              num_kv_heads=self.heads.num_kv_heads, head_dim=cfg.head_dim, dtype=self.kv_dtype,
                              device=self.device, v_head_dim=cfg.kv_lora_rank if cfg.is_mla else None)
        # rows: one per running request, one for scoring (prompt_logits), one for CUDA graphs' padding
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 2, self.context_len + page, self.device)
        logger.info("KV pool: %d tokens (%d pages of %d), %.1f MB in %s", self.max_total_tokens, num_pages - 1,
                    page, self.max_total_tokens * per_token / 2**20, kv_dtype_name(self.kv_dtype))

    def init_cuda_graphs(self, capturer: GraphCapturer | None = None) -> None:
        """Capture the decode graphs (radixserve.engine.graph_setup): CUDA graphs on CUDA, kernel
        tapes on CPU, unless a reason keeps decode eager (logged); with a ``capturer``, that one
        (tests: :class:`FakeGraphCapturer`). Called again, it replaces the graphs it made."""
        if self.graph_runner is not None:
            self.graph_runner.close()
        self.graph_runner, self.verify_tapes = build_graphs(self, capturer)

    # -------------------------------------------------------------- forward
    def slots_for(self, req: Req, start: int, end: int) -> list[int]:
        """KV slots of positions [start, end) of ``req``; its pages must already cover them."""
        page, pages = self.kv_pool.page_size, req.pages
        if page == 1:
            return pages[start:end]
        return [pages[p // page] * page + p % page for p in range(start, end)]

    def build_batch(self, reqs: list[Req], mode: ForwardMode, extend_lens: list[int] | None = None) -> ForwardBatch:
        """One step's batch. Extend computes ``extend_lens[i]`` tokens of request ``i`` from
        its ``kv_len`` on; decode computes each request's last token. A mixed batch is an
        extend whose trailing decoding requests (``extend_lens`` 1, only their last token
        uncomputed) form its ``num_decode`` decode rows. Writes the new tokens' slots into
        the request-to-token table."""
        dev = self.device
        table = self.req_to_token_pool.req_to_token
        rows = [r.req_pool_idx for r in reqs]
        if mode is ForwardMode.DECODE:
            seq_lens = [r.seq_len for r in reqs]
            positions = [n - 1 for n in seq_lens]
            slots = [self.slots_for(r, n - 1, n)[0] for r, n in zip(reqs, seq_lens)]
            input_ids = [r.output_ids[-1] if r.output_ids else r.input_ids[-1] for r in reqs]
            prefix_lens = positions
            extend_lens = [1] * len(reqs)
            rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
            pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
            slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
            table[rows_t, pos_t] = slots_t
            logits_idx = torch.arange(len(reqs), device=dev)
        else:
            input_ids, positions, slots, prefix_lens, seq_lens = [], [], [], [], []
            for r, n in zip(reqs, extend_lens):
                prefix, total = r.kv_len, r.kv_len + n
                s = self.slots_for(r, prefix, total)
                table[r.req_pool_idx, prefix:total] = torch.tensor(s, dtype=torch.int64, device=dev)
                input_ids.extend(r.all_ids[prefix:total])
                positions.extend(range(prefix, total))
                slots.extend(s)
                prefix_lens.append(prefix)
                seq_lens.append(total)
            rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
            pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
            slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
            logits_idx = torch.tensor(extend_lens, device=dev).cumsum(0) - 1
        batch = ForwardBatch(
            mode=mode, batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=pos_t, req_pool_indices=rows_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            out_cache_loc=slots_t, seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=list(extend_lens), req_to_token=table, kv_pool=self.kv_pool,
            logits_indices=logits_idx, capture_hidden_layers=self.capture_hidden_layers,
        )
        batch.capture_final_hidden = any(r.params.return_hidden_states for r in reqs)
        batch.lora_slots = self.lora.slots_for(reqs) if self.lora is not None else None
        if self.dp_attention is not None:
            batch.dp_groups = [r.dp_group for r in reqs]
        if mode is ForwardMode.MIXED:
            batch.num_decode = trailing_decode_rows(reqs)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and any(r.params.wants_prompt_logprobs for r in reqs):
            self._add_prompt_logprob_rows(batch, reqs, extend_lens)
        return batch

    def _add_prompt_logprob_rows(self, batch: ForwardBatch, reqs: list[Req], extend_lens: list[int]) -> None:
        """Also compute logits at the positions whose prompt logprobs this chunk owes.

        ``logits_indices`` becomes the sorted union of each request's last row and those
        rows (so a model that skips the gather when every row is wanted stays right);
        :meth:`forward` reduces the extra rows to logprobs right away and returns only
        the last rows, as always."""
        rows: list[int] = []  # hidden-state rows whose logits are computed, ascending
        last: list[int] = []  # per request: index of its last row in ``rows``
        spans: list[tuple[Req, int, int, int]] = []  # (req, first index in rows, count, first position)
        offset = 0
        for r, n in zip(reqs, extend_lens):
            prefix = r.kv_len
            a, b = r.prompt_logprob_span(prefix, prefix + n)
            if b > a:
                spans.append((r, len(rows), b - a, a))
                rows.extend(range(offset + a - prefix, min(offset + b - prefix, offset + n - 1)))
            rows.append(offset + n - 1)
            last.append(len(rows) - 1)
            offset += n
        if not spans:
            return
        batch.extra["prompt_logprob_plan"] = (spans, torch.tensor(last, device=self.device), batch.logits_indices)
        batch.logits_indices = torch.tensor(rows, device=self.device)

    def _reduce_prompt_logprobs(self, batch: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        """Turn the extra rows of ``logits  # [R, V]`` into each request's prompt logprobs
        (``batch.extra["prompt_logprobs"]``: (req, logprobs, tops) per request); returns
        the last rows ``# [B, V]`` and puts the batch's ``logits_indices`` back."""
        spans, last, logits_indices = batch.extra.pop("prompt_logprob_plan")
        results = []
        for req, row, count, first in spans:
            targets = torch.tensor(req.input_ids[first + 1:first + 1 + count], dtype=torch.int64,
                                   device=logits.device)  # [count]
            lps, tops = prompt_logprobs(logits[row:row + count], targets, req.params.top_logprobs_num)
            results.append((req, lps, tops))
        batch.extra["prompt_logprobs"] = results
        batch.logits_indices = logits_indices
        return logits[last]

    def build_verify_batch(self, reqs: list[Req], trees: list[tuple[list[int], list[int]]]) -> ForwardBatch:
        """A target-verify batch: request ``i`` computes the nodes of ``trees[i] =
        (node_parents, node_tokens)`` (node 0 its last token, at position ``seq_len - 1``);
        node ``j`` takes the slot of column ``seq_len - 1 + j``. Logits come back for every
        node. The request's pages must cover those columns."""
        dev = self.device
        table = self.req_to_token_pool.req_to_token
        input_ids, positions, slots, prefix_lens, seq_lens, ext_lens, masks, offsets = [], [], [], [], [], [], [], []
        offset = 0
        for r, (parents, tokens) in zip(reqs, trees):
            prefix, n = r.seq_len - 1, len(tokens)
            s = self.slots_for(r, prefix, prefix + n)
            table[r.req_pool_idx, prefix:prefix + n] = torch.tensor(s, dtype=torch.int64, device=dev)
            input_ids.extend(tokens)
            positions.extend(prefix + d for d in tree.depths(parents))
            slots.extend(s)
            prefix_lens.append(prefix)
            seq_lens.append(prefix + n)
            ext_lens.append(n)
            masks.append(tree.ancestor_mask(parents).reshape(-1))
            offsets.append(offset)
            offset += n * n
        total = len(input_ids)
        return ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev), seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens, extend_lens_cpu=ext_lens, req_to_token=table, kv_pool=self.kv_pool,
            logits_indices=torch.arange(total, device=dev),
            tree_mask=torch.cat(masks).to(dev), tree_mask_offsets_cpu=offsets,
            capture_hidden_layers=self.capture_hidden_layers,
            lora_slots=self.lora.slots_for(reqs) if self.lora is not None else None,
        )

    @torch.inference_mode()
    def prompt_logits(self, input_ids: list[int]) -> torch.Tensor:
        """Logits ``# [T, V]`` at every position of one prompt (scoring and tests).

        Borrows pages and a request slot for the duration of the call and returns them.
        """
        from radixserve.sampling import SamplingParams

        page = self.kv_pool.page_size
        req = Req("score", list(input_ids), SamplingParams(max_new_tokens=0), 0)
        req.req_pool_idx = self.req_to_token_pool.alloc()
        try:
            req.pages = self.kv_pool.allocator.allocate(-(-len(input_ids) // page))
            batch = self.build_batch([req], ForwardMode.EXTEND, [len(input_ids)])
            batch.logits_indices = torch.arange(len(input_ids), device=self.device)
            return self.forward(batch)
        finally:
            self.kv_pool.allocator.free(req.pages)
            self.req_to_token_pool.free(req.req_pool_idx)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to ``dst`` (speculative decoding); the
        other ranks of a multi-rank replica do the same before their next step."""
        self.kv_pool.move_kv(src, dst)
        if self.step_driver is not None:
            self.step_driver.defer("move_kv", src, dst)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``# [B, V]`` (float32) for the last new token of each request. On a
        multi-rank replica every rank runs the same step (rank 0 sends it first). An
        extend batch whose requests ask for prompt logprobs also leaves them in
        ``batch.extra["prompt_logprobs"]`` (see :meth:`_add_prompt_logprob_rows`)."""
        if self.step_driver is None:
            logits = self.forward_local(batch)
        else:
            with self.step_driver.step(batch):
                logits = self.forward_local(batch)
        if "prompt_logprob_plan" in batch.extra:
            logits = self._reduce_prompt_logprobs(batch, logits)
        return logits

    @torch.inference_mode()
    def forward_local(self, batch: ForwardBatch) -> torch.Tensor:
        """This rank's part of a step (followers call it for each step rank 0 sends)."""
        if self.lora is not None:  # the step's adapters, read by the adapted linear layers
            with lora_step(self.lora.step(batch.lora_slots, batch.extend_lens_cpu)):
                return self._forward_parts(batch)
        return self._forward_parts(batch)

    def _forward_parts(self, batch: ForwardBatch) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.run(batch)
        if self.context is not None and context_splits(batch):
            return self.context.run(batch)
        if self.dp_attention is not None:  # this group's requests, or only the MoE layers' collectives
            logits = self.dp_attention.run(batch)
        else:
            logits = self._forward_whole(batch)
        if self.expert_distribution is not None:
            self.expert_distribution.on_forward(int(batch.input_ids.shape[0]))
        return logits


    def _forward_whole(self, batch: ForwardBatch) -> torch.Tensor:
        logits = None
        if self.two_batch is not None and self.two_batch.can_run(batch):
            return self.two_batch.run(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.replay(batch)  # None: the backend asked for an eager step
        elif self.verify_tapes is not None and self.verify_tapes.can_run(batch):
            logits = self.verify_tapes.replay(batch)
        if logits is None:
            self.attn_backend.init_forward_metadata(batch)
            logits = self.model(batch)
        return logits
