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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import get_parallel_state, split_range, tp_all_gather, tp_all_reduce
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import tape
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
        self.qtable: GGUFTensor | None = None  # [V_local, H] in blocks
        self.out_dtype = torch.float32  # the lookup's dtype from a block table (finalize sets it)
        self.weight = None if self.keeps_blocks else nn.Parameter(torch.empty(self.num_local, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids  # [T]`` -> ``# [T, H]``."""
        if not self.is_split:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)  # [T] ids another rank holds
        x = self._lookup(local.masked_fill(outside, 0))  # [T, H]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(x)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.load() if ids.device.type == "cpu" else None
        if self.qtable is None:
            w = self.weight
            if kernels is not None and ids.dim() == 1 and ids.dtype == torch.int64 and w.is_contiguous():
                if not tape.recording():  # a replayed step checks its ids before it runs
                    check_ids(ids, w.shape[0])
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
        if self.qtable is None:
            return self.weight.detach()
        return self.qtable.dequantize().to(self.out_dtype)

    def weight_nbytes(self) -> int:
        t = self.qtable.data if self.qtable is not None else self.weight
        return t.numel() * t.element_size()

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's rows of the full ``[V, H]`` checkpoint table."""
        if name != "weight" or part is not None or tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint embedding {name} of shape {tuple(tensor.shape)}: expected "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        mine = tensor.narrow(0, self.vocab_start, self.num_local)
        if isinstance(mine, GGUFTensor):
            if self.keeps_blocks:
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
