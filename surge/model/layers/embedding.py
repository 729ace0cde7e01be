"""Token embedding and LM head (which may share the embedding's weight), split over the vocabulary.

Each rank holds ceil(V / tp) rows (the last rank's tail is zero padding). The embedding looks up the ids it owns
and sums over the ranks; the LM head computes its slice of the logits and rank 0 gathers the full row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.distributed.parallel_state import get_tp_group
from surge.model.layers.gemm import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.shape != (self.vocab_size, *param.shape[1:]):  # a weight, or the LM head's bias
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit the vocabulary "
                             f"{(self.vocab_size, *param.shape[1:])}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        """bias: a logit bias per token (Phi-2), split over the vocabulary like the weight."""
        super().__init__(vocab_size, hidden_size)
        self.register_parameter("bias", nn.Parameter(torch.zeros(self.rows_per_rank), requires_grad=False)
                                if bias else None)
        if bias:
            self.bias.weight_loader = self.weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, V] on rank 0; None on the other ranks."""
        logits = linear(hidden, self.weight, self.bias, owner=self)
        if self.tp_size == 1:
            return logits
        full = get_tp_group().gather(logits, dim=-1)
        return None if full is None else full[:, :self.vocab_size]
