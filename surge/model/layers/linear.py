"""Linear layers whose parameters know how to load their checkpoint shards (`weight_loader`), split for tensor
parallelism: column-parallel layers keep a slice of the output features, row-parallel ones a slice of the input
features and sum the partial products over the ranks.

Each loader copies only this rank's slice of a checkpoint tensor, so no rank ever holds a full merged weight.
Merged projections (q/k/v, gate/up) are one GEMM; each checkpoint tensor lands in its slice by shard id. With one
rank every layer is a plain linear layer and no collective runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.distributed.parallel_state import get_tp_group


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads are split across ranks, or replicated (one per rank) when there are more ranks than heads."""
    return max(1, num_kv_heads // tp_size)


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what}={size} does not split evenly over tensor_parallel_size={tp_size}")
    return size // tp_size


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(Linear):
    """Several projections of one input stacked along the output dimension; each rank keeps its slice of every
    projection, so the local output is [proj0 slice | proj1 slice | ...]."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int | None, int], bias: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.shard_sizes = dict(shard_sizes)  # full (checkpoint) rows of each projection
        # shard id -> (offset in the local weight, local rows, first checkpoint row of this rank's slice)
        self.shard_layout: dict[str | int | None, tuple[int, int, int]] = {}
        offset = 0
        for shard_id, (local, source_start) in self._local_shards().items():
            self.shard_layout[shard_id] = (offset, local, source_start)
            offset += local
        super().__init__(in_features, offset, bias)

    def _local_shards(self) -> dict[str | int | None, tuple[int, int]]:
        """shard id -> (rows on this rank, first checkpoint row of them)."""
        out = {}
        for shard_id, size in self.shard_sizes.items():
            local = _split(size, self.tp_size, f"output size of shard {shard_id!r}")
            out[shard_id] = (local, self.tp_rank * local)
        return out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id not in self.shard_layout:
            if shard_id is None and self.tp_size == 1:  # the checkpoint holds the merged tensor already
                return default_weight_loader(param, loaded)
            raise ValueError(f"shard {shard_id!r} is not one of {list(self.shard_layout)}")
        offset, size, source_start = self.shard_layout[shard_id]
        target = param.data.narrow(0, offset, size)
        if loaded.shape[0] != self.shard_sizes[shard_id] or loaded.shape[1:] != target.shape[1:]:
            raise ValueError(f"checkpoint shard {shard_id!r} of shape {tuple(loaded.shape)} does not fit its slice "
                             f"of shape {tuple(target.shape)} (rows {source_start}..{source_start + size} of "
                             f"{self.shard_sizes[shard_id]}, rank {self.tp_rank} of {self.tp_size})")
        target.copy_(loaded.narrow(0, source_start, size))


class ColumnParallelLinear(MergedColumnParallelLinear):
    """Output features split over the ranks; the output stays split (the next layer is row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, {None: out_features}, bias)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections; each rank keeps num_heads / tp query heads and their KV heads. With more ranks than
    KV heads, tp / num_kv_heads consecutive ranks share (replicate) one KV head."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim}, bias)
        self.num_heads = _split(num_heads, self.tp_size, "num_attention_heads")
        self.num_kv_heads = num_kv_heads_per_rank(num_kv_heads, self.tp_size)

    def _local_shards(self) -> dict[str | int | None, tuple[int, int]]:
        tp, rank, d = self.tp_size, self.tp_rank, self.head_dim
        heads = _split(self.total_num_heads, tp, "num_attention_heads")
        kv = self.total_num_kv_heads
        if tp <= kv:
            kv_local = _split(kv, tp, "num_key_value_heads")
            kv_start = rank * kv_local
        else:
            if tp % kv:
                raise ValueError(f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={kv}")
            kv_local, kv_start = 1, rank // (tp // kv)
        return {"q": (heads * d, rank * heads * d), "k": (kv_local * d, kv_start * d),
                "v": (kv_local * d, kv_start * d)}


class RowParallelLinear(Linear):
    """Input features split over the ranks (the input arrives split, from a column-parallel layer); the partial
    products are summed over the ranks. The bias is added once, by rank 0, before the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(_split(in_features, self.tp_size, "input size"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # the bias: replicated
            return default_weight_loader(param, loaded)
        size = param.shape[1]
        if loaded.dim() != 2 or loaded.shape[0] != param.shape[0] or loaded.shape[1] != size * self.tp_size:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                             f"{tuple(param.shape)} (input split over {self.tp_size} ranks)")
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return get_tp_group().all_reduce(out)
