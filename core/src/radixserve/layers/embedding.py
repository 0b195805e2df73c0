"""Vocabulary-parallel token embedding and LM head.

Both split the vocabulary the same way over the tensor-parallel ranks (as evenly as
possible in rank order, the first ``vocab % tp_size`` ranks one row more), so a tied LM
head holds exactly the rows of its rank's embedding shard.

* :class:`VocabParallelEmbedding`: each rank looks up the ids in its rows, writes zeros for
  the others, and one ``tp_all_reduce`` gives every rank the full embeddings.
* :class:`ParallelLMHead`: each rank computes the logits of its rows, and
  ``tp_all_gather`` concatenates them in rank order (shards may differ by one column).

On a single rank both are the plain embedding lookup and linear layer.

Under ``--quantization gguf`` the embedding keeps a GGUF table in its blocks and dequantises
only the rows it looks up (:func:`radixserve.kernels.gguf.dequant_rows`); a tied LM head gets
the same blocks as its weight.

A float16/bfloat16 table (an F16/BF16 GGUF tensor, a 16-bit safetensors checkpoint) stays in
its 16 bits on CPU under ``--dtype auto`` and the looked-up rows are widened (exactly). When a
tied LM head keeps those values in a 16-bit matrix (:class:`radixserve.kernels.woq.F16Matrix`,
``BF16Matrix``), :meth:`VocabParallelEmbedding.share_with` drops the table and looks rows up
in the head's panels: one 16-bit copy serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import get_parallel_state, split_range, tp_all_gather, tp_all_reduce
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import tape, woq
from radixserve.kernels.gguf import HALF_TYPES
from radixserve.layers.linear import ColumnParallelLinear, even_shard
from radixserve.quantization import GGUFTensor, current_config


class VocabParallelEmbedding(nn.Module):
    """``weight  # [V_local, H]``: rows ``[vocab_start, vocab_start + V_local)`` of the table."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.num_local = split_range(num_embeddings, state.tp_size, state.tp_rank)
        self.is_split = state.tp_size > 1
        config = current_config()
        # a GGUF table stays in blocks: the float table is made only if a float tensor arrives
        self.keeps_blocks = config is not None and config.embedding_keeps_blocks()
        # a 16-bit float table stays 16-bit (CPU, --dtype auto)
        self.keeps_16bit = config is not None and config.embedding_keeps_16bit()
        self.qtable: GGUFTensor | None = None  # [V_local, H] in blocks
        self.table16: torch.Tensor | None = None  # [V_local, H] float16/bfloat16 as the checkpoint stores it
        self.shared = None  # a tied LM head's 16-bit matrix, whose rows the lookup reads (share_with)
        self.out_dtype = torch.float32  # the lookup's dtype from a block or 16-bit table (finalize sets it)
        lazy = self.keeps_blocks or self.keeps_16bit  # the float table is made only if a float tensor arrives
        self.weight = None if lazy else nn.Parameter(torch.empty(self.num_local, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids  # [T]`` -> ``# [T, H]``."""
        if not self.is_split:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)  # [T] ids another rank holds
        x = self._lookup(local.masked_fill(outside, 0))  # [T, H]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(x)

    def local_rows(self, device: torch.device) -> torch.Tensor:
        """This rank's rows of the table, ``# [V_local, H]`` as lookups return them (a GGUF table
        dequantized)."""
        return self._lookup(torch.arange(self.num_local, dtype=torch.int64, device=device))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.load() if ids.device.type == "cpu" else None
        fast = kernels is not None and ids.dim() == 1 and ids.dtype == torch.int64
        if fast and not tape.recording():  # a replayed step checks its ids before it runs
            check_ids(ids, self.num_local)
        if self.shared is not None or self.table16 is not None:
            if fast:  # rows widened in C (a recordable call)
                rows = woq.half_rows(kernels, self.shared if self.shared is not None else self.table16, ids)
                return rows if self.out_dtype == torch.float32 else rows.to(self.out_dtype)
            if self.shared is not None:
                rows = self.shared.take_rows(ids.reshape(-1))  # [T, H] 16-bit
                return rows.to(self.out_dtype).reshape(*ids.shape, self.embedding_dim)
            return F.embedding(ids, self.table16).to(self.out_dtype)
        if self.qtable is None:
            w = self.weight
            if fast and w.is_contiguous():
                return kernels.gather_rows(w, ids)  # a plain copy of rows, in C (a recordable call)
            return F.embedding(ids, w)
        t = self.qtable
        if kernels is not None:
            from radixserve.kernels import gguf as gguf_kernels

            if t.qtype in gguf_kernels.KERNEL_TYPES:
                rows = gguf_kernels.dequant_rows(kernels, t.qtype, t.data, ids.reshape(-1).to(torch.int64), t.cols)
                return rows.to(self.out_dtype).reshape(*ids.shape, t.cols)
        rows = GGUFTensor(t.qtype, t.data.index_select(0, ids.reshape(-1).cpu()), t.cols).dequantize()
        return rows.to(device=ids.device, dtype=self.out_dtype).reshape(*ids.shape, t.cols)

    def finalize(self, dtype: torch.dtype) -> None:
        self.out_dtype = dtype

    def dense_weight(self) -> torch.Tensor:
        """This rank's rows as a float table ``[V_local, H]``: the weight, or the GGUF
        blocks dequantised (the values every lookup returns)."""
        if self.shared is not None:
            return self.shared.dequantize().to(self.out_dtype)
        if self.table16 is not None:
            return self.table16.to(self.out_dtype)
        if self.qtable is None:
            return self.weight.detach()
        return self.qtable.dequantize().to(self.out_dtype)

    def weight_nbytes(self) -> int:
        """Resident bytes of the table (0 when it is a tied LM head's: the head counts them)."""
        if self.shared is not None:
            return 0
        t = next(t for t in (self.table16, self.qtable, self.weight) if t is not None)
        t = t.data if isinstance(t, GGUFTensor) else t
        return t.numel() * t.element_size()

    @torch.no_grad()
    def share_with(self, head: nn.Module) -> bool:
        """A tied LM head (packed): when it keeps this 16-bit table's values in a matrix that gives
        rows back (``take_rows``), look rows up there and drop the table. Returns whether it does."""
        matrix = getattr(head, "matrix", None)
        if matrix is None and len(getattr(head, "matrices", ())) == 1:
            matrix = head.matrices[0][2]
        if self.table16 is None or not hasattr(matrix, "take_rows"):
            return False
        if (matrix.n, matrix.k) != tuple(self.table16.shape):
            return False
        probe = torch.tensor(sorted({0, self.num_local // 2, self.num_local - 1}))
        rows = matrix.take_rows(probe)
        if rows.dtype != self.table16.dtype or not torch.equal(rows, self.table16[probe]):
            return False
        self.shared, self.table16 = matrix, None
        return True

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's rows of the full ``[V, H]`` checkpoint table."""
        if name != "weight" or part is not None or tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint embedding {name} of shape {tuple(tensor.shape)}: expected "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        mine = tensor.narrow(0, self.vocab_start, self.num_local)
        half = HALF_TYPES.get(mine.qtype) if isinstance(mine, GGUFTensor) else mine.dtype
        if self.keeps_16bit and half in (torch.float16, torch.bfloat16):  # kept as stored, rows widened
            table = mine.data.view(half) if isinstance(mine, GGUFTensor) else mine.detach()
            self.table16, self.weight = (table.clone() if self.is_split else table.contiguous()), None
            return
        if isinstance(mine, GGUFTensor):
            if self.keeps_blocks and mine.qtype not in HALF_TYPES:
                self.qtable, self.weight = GGUFTensor(mine.qtype, mine.data.contiguous(), mine.cols), None
                return
            mine = mine.dequantize()
        if self.weight is None:  # a float table where blocks were expected (an F32/F16 GGUF tensor)
            self.weight = nn.Parameter(torch.empty(self.num_local, self.embedding_dim))
        self.weight.copy_(mine)


def check_ids(ids: torch.Tensor, rows: int) -> None:
    """Raise IndexError unless every id lies in ``[0, rows)``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"token ids out of range [0, {rows})")


class ParallelLMHead(ColumnParallelLinear):
    """The LM head, vocabulary rows split like :class:`VocabParallelEmbedding`'s; returns
    the full logits ``# [B, V]`` on every rank."""

    is_lm_head = True  # quantization methods may keep it wider than the other linears

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, {"": even_shard(vocab_size)})
        state = get_parallel_state()
        self.shard_sizes = [split_range(vocab_size, state.tp_size, r)[1] for r in range(state.tp_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # [B, V_local]
        return tp_all_gather(logits, self.shard_sizes)  # [B, V]
