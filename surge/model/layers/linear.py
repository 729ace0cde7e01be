"""Linear layers whose parameters know how to load their checkpoint shards (`weight_loader`), split for tensor
parallelism: column-parallel layers keep a slice of the output features, row-parallel ones a slice of the input
features and sum the partial products over the ranks.

Each loader copies only this rank's slice of a checkpoint tensor, so no rank ever holds a full merged weight.
Merged projections (q/k/v, gate/up) are one GEMM; each checkpoint tensor lands in its slice by shard id. With one
rank every layer is a plain linear layer and no collective runs.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from surge.distributed.parallel_state import get_tp_group
from surge.model.quant.base import UNQUANTIZED, WEIGHT, LinearMethod


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    sharding = getattr(param, "sharding", WEIGHT)
    if loaded.numel() == 1 and (sharding.scalar or sharding.reduce_max):
        return _fill(param.data, loaded, sharding)
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _fill(target: torch.Tensor, loaded: torch.Tensor, sharding) -> None:
    """A per-tensor checkpoint value: every element of its rows (scalar), or the largest seen (reduce_max)."""
    value = loaded.reshape(()).to(target.device, target.dtype)
    if sharding.reduce_max:
        target.copy_(torch.maximum(target, value))
    else:
        target.copy_(value.expand_as(target))


def _narrow(param: nn.Parameter, loaded: torch.Tensor, dim: int, dst_start: int, src_start: int, size: int,
            what: str) -> None:
    """Copy checkpoint elements [src_start, src_start + size) along `dim` into the parameter's [dst_start, ...),
    both counted in checkpoint elements (a scale or packed parameter divides them by its sharding)."""
    sharding = getattr(param, "sharding", WEIGHT)
    div = (sharding.out_div if dim == 0 else sharding.in_div) or 1
    if loaded.numel() == 1 and (sharding.scalar or sharding.reduce_max):
        target = param.data if sharding.reduce_max else param.data.narrow(dim, dst_start // div, -(-size // div))
        return _fill(target, loaded, sharding)
    if dst_start % div or src_start % div:
        raise ValueError(f"{what} starts at element {src_start} (to {dst_start}), not a multiple of the "
                         f"quantization block {div} along dimension {dim}: this split cannot hold it")
    count = -(-size // div)
    target = param.data.narrow(dim, dst_start // div, count)
    source = loaded.narrow(dim, src_start // div, count)
    if source.shape != target.shape:
        raise ValueError(f"{what} of shape {tuple(loaded.shape)} does not fit its slice of shape "
                         f"{tuple(target.shape)}")
    on_load = getattr(param, "on_load", None)
    if on_load is not None:  # a method converting as it loads (online quantization)
        return on_load(param, dim, dst_start // div, source)
    target.copy_(source)


_DEFER = [False]


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear layers built inside create no weights: a quantization config assigns each its method afterwards, which
    creates them (a quantized model never allocates its unquantized weights)."""
    _DEFER[0] = True
    try:
        yield
    finally:
        _DEFER[0] = False


def weights_deferred() -> bool:
    return _DEFER[0]


@dataclass(frozen=True)
class HeadShard:
    """One rank's query heads [q_start, q_start + q_count) and the KV heads they read."""
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """KV heads are split as evenly as possible (when tp does not divide them, the first ranks take one more), each
    with its whole group of query heads; with more ranks than KV heads, tp / num_kv_heads consecutive ranks
    replicate one KV head and split its query heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        base, extra = divmod(num_kv_heads, tp_size)
        kv_count = base + (rank < extra)
        kv_start = rank * base + min(rank, extra)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds num_key_value_heads={num_kv_heads}: it must be a "
                         f"multiple of them and divide num_attention_heads={num_heads}")
    q_count = num_heads // tp_size
    return HeadShard(rank * q_count, q_count, rank // (tp_size // num_kv_heads), 1)


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int, rank: int = 0) -> int:
    """KV heads this rank holds (rank 0 holds the most)."""
    return head_shard(num_kv_heads, num_kv_heads, tp_size, rank).kv_count if tp_size <= num_kv_heads else 1


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what}={size} does not split evenly over tensor_parallel_size={tp_size}")
    return size // tp_size


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight. Its LinearMethod (surge/model/quant) creates and applies the
    weight; quantizable=False: a layer read directly (a router's F.linear) that must stay unquantized. `lora`: the
    layer's LoRA adapter slots (surge/model/layers/lora.py) once an engine with LoRA attached them, else None."""
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantizable: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = torch.get_default_dtype()
        self.quantizable = quantizable
        self.quant_method: LinearMethod = UNQUANTIZED
        if not (_DEFER[0] and quantizable):
            UNQUANTIZED.create_weights(self, None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def set_method(self, method: LinearMethod, device: torch.device | None) -> None:
        self.quant_method = method
        method.create_weights(self, device)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        on_load = getattr(param, "on_load", None)
        if on_load is not None and loaded.shape == param.shape:  # a method converting as it loads
            return on_load(param, 0, 0, loaded)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_(y, x)
        return y

    # ---- LoRA: where an adapter's A [r, in] and B [out, r] go on this rank ----
    def lora_slices(self) -> list[tuple[int, int]]:
        """(first local output row, rows) of each projection an adapter may target separately."""
        return [(0, self.out_features)]

    def lora_parts(self, shard_id: str | int | None, a: torch.Tensor, b: torch.Tensor,
                   what: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of an adapter's (A, B) for one checkpoint projection: slice index -> (A, B)."""
        _check_lora_shape(what, a, b, self.in_features, self.out_features)
        return {0: (a, b)}


def _check_lora_shape(what: str, a: torch.Tensor, b: torch.Tensor, in_features: int, out_features: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features or \
            a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA weights of {what}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                         f"the base layer ({in_features} inputs, {out_features} outputs): expected lora_A "
                         f"[r, {in_features}] and lora_B [{out_features}, r]")


class MergedColumnParallelLinear(Linear):
    """Several projections of one input stacked along the output dimension; each rank keeps its slice of every
    projection, so the local output is [proj0 slice | proj1 slice | ...]."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int | None, int], bias: bool = False,
                 quantizable: bool = True) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.shard_sizes = dict(shard_sizes)  # full (checkpoint) rows of each projection
        # shard id -> (offset in the local weight, local rows, first checkpoint row of this rank's slice)
        self.shard_layout: dict[str | int | None, tuple[int, int, int]] = {}
        offset = 0
        for shard_id, (local, source_start) in self._local_shards().items():
            self.shard_layout[shard_id] = (offset, local, source_start)
            offset += local
        super().__init__(in_features, offset, bias, quantizable)

    def _local_shards(self) -> dict[str | int | None, tuple[int, int]]:
        """shard id -> (rows on this rank, first checkpoint row of them)."""
        out = {}
        for shard_id, size in self.shard_sizes.items():
            local = _split(size, self.tp_size, f"output size of shard {shard_id!r}")
            out[shard_id] = (local, self.tp_rank * local)
        return out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id not in self.shard_layout:
            if shard_id is None:  # the checkpoint holds the merged tensor already (Phi-3's qkv_proj, gate_up_proj)
                return self._load_fused(param, loaded)
            raise ValueError(f"shard {shard_id!r} is not one of {list(self.shard_layout)}")
        offset, size, source_start = self.shard_layout[shard_id]
        div = getattr(param, "sharding", WEIGHT).out_div or 1
        if loaded.numel() > 1 and loaded.shape[0] != -(-self.shard_sizes[shard_id] // div):
            raise ValueError(f"checkpoint shard {shard_id!r} of shape {tuple(loaded.shape)} does not fit its slice "
                             f"of parameter shape {tuple(param.shape)} (rows {source_start}..{source_start + size} "
                             f"of {self.shard_sizes[shard_id]}, rank {self.tp_rank} of {self.tp_size})")
        _narrow(param, loaded, 0, offset, source_start, size, f"checkpoint shard {shard_id!r}")

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor of every projection stacked in shard order (full sizes): each part loads as its
        shard, so each rank keeps its own slice of each."""
        div = getattr(param, "sharding", WEIGHT).out_div or 1
        sizes = [-(-size // div) for size in self.shard_sizes.values()]
        if loaded.shape[0] != sum(sizes):
            raise ValueError(f"fused checkpoint tensor of shape {tuple(loaded.shape)} does not stack the shards "
                             f"{self.shard_sizes} ({sum(sizes)} rows)")
        for shard_id, part in zip(self.shard_sizes, loaded.split(sizes, dim=0)):
            self.weight_loader(param, part, shard_id)

    def lora_slices(self) -> list[tuple[int, int]]:
        return [(offset, local) for offset, local, _ in self.shard_layout.values()]

    def lora_parts(self, shard_id: str | int | None, a: torch.Tensor, b: torch.Tensor,
                   what: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Column-parallel: A whole, B's rows of this rank. An adapter of the merged projection itself (shard None on
        a layer of several: Phi-3's qkv_proj) has one A for all, and its B stacks them in shard order."""
        shard_ids = list(self.shard_layout)
        if shard_id not in self.shard_layout:
            _check_lora_shape(what, a, b, self.in_features, sum(self.shard_sizes.values()))
            parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for sid, part in zip(self.shard_sizes, b.split(list(self.shard_sizes.values()), dim=0)):
                parts.update(self.lora_parts(sid, a, part, what))
            return parts
        offset, local, source_start = self.shard_layout[shard_id]
        _check_lora_shape(what, a, b, self.in_features, self.shard_sizes[shard_id])
        return {shard_ids.index(shard_id): (a, b.narrow(0, source_start, local))}


class ColumnParallelLinear(MergedColumnParallelLinear):
    """Output features split over the ranks; the output stays split (the next layer is row-parallel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantizable: bool = True) -> None:
        super().__init__(in_features, {None: out_features}, bias, quantizable)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections; each rank keeps the query heads and KV heads of its `head_shard`."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        tp = get_tp_group()
        self.shard = head_shard(num_heads, num_kv_heads, tp.world_size, tp.rank)
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim}, bias)
        self.num_heads, self.num_kv_heads = self.shard.q_count, self.shard.kv_count

    def _local_shards(self) -> dict[str | int | None, tuple[int, int]]:
        d, sh = self.head_dim, self.shard
        return {"q": (sh.q_count * d, sh.q_start * d), "k": (sh.kv_count * d, sh.kv_start * d),
                "v": (sh.kv_count * d, sh.kv_start * d)}


class RowParallelLinear(Linear):
    """Input features split over the ranks (the input arrives split, from a column-parallel layer); the partial
    products are summed over the ranks. The bias is added once, by rank 0, before the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 input_shard: tuple[int, int] | None = None, reduce_results: bool = True) -> None:
        """input_shard: (first input feature, count) of this rank when the split is not even (attention heads).
        reduce_results False: each rank's partial product is returned unsummed, for a caller that adds other
        partials (a MoE's shared expert beside its routed ones) before one all-reduce of their sum."""
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.reduce_results = reduce_results
        self.full_in_features = in_features
        if input_shard is None:
            size = _split(in_features, self.tp_size, "input size")
            input_shard = (self.tp_rank * size, size)
        self.input_start = input_shard[0]
        super().__init__(input_shard[1], out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        sharding = getattr(param, "sharding", WEIGHT)
        if param.dim() == 1 or sharding.in_div is None:  # the bias, per-row or per-tensor scales: replicated
            return default_weight_loader(param, loaded)
        div = sharding.in_div
        if loaded.dim() != 2 or loaded.shape[0] != param.shape[0] or \
                loaded.shape[1] != -(-self.full_in_features // div):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter of shape "
                             f"{tuple(param.shape)} (input split over {self.tp_size} ranks)")
        _narrow(param, loaded, 1, 0, self.input_start, self.in_features, "checkpoint tensor")

    def lora_parts(self, shard_id: str | int | None, a: torch.Tensor, b: torch.Tensor,
                   what: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Row-parallel: A's input columns of this rank, B whole (the partial deltas sum in the all-reduce)."""
        _check_lora_shape(what, a, b, self.full_in_features, self.out_features)
        return {0: (a.narrow(1, self.input_start, self.in_features), b)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:  # before the sum: each rank's share of the delta
            self.lora.add_(out, x)
        return out if self.tp_size == 1 or not self.reduce_results else get_tp_group().all_reduce(out)
