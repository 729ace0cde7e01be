"""Mixture of experts: a router (softmax over experts, top-k, optionally renormalized) and the experts' SiLU-gated
MLPs, whose weights are stacked per layer ([E, 2I, H] gate|up and [E, H, I] down) from per-expert checkpoint tensors.

Split over the tensor-parallel ranks two ways. Without expert parallelism each rank holds a slice of every expert's
intermediate size, like a dense MLP. With it (EP size = TP size) each rank holds E / tp whole experts. Either way
every rank already holds every token (attention is tensor-parallel, its output all-reduced), so dispatch is local:
a rank runs its experts on the tokens routed to them, and one all-reduce of the partial outputs combines them, the
same collective and volume as a dense row-parallel MLP. An all-to-all pays only once tokens differ between ranks
(data-parallel attention), which Surge does not do yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.distributed.parallel_state import get_ep_group, get_tp_group
from surge.model.layers.linear import Linear

# Checkpoint shard ids of expert tensors: (projection, expert) for one expert's tensor, or (projection, None) for
# all experts stacked already (HF transformers 5 models in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]).
_PROJECTIONS = ("gate", "up", "down", "gate_up")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
                   use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k]): softmax in float32 over the experts, the top k, divided by
    their sum when renormalize (norm_topk_prob), as HF transformers routes.

    use_kernel: None, the fused router kernel on CUDA (one launch instead of softmax, topk's sorts and the sum;
    int32 ids, ties to the lowest expert id) and torch elsewhere; True, the kernel on any device (tests, under
    TRITON_INTERPRET=1); False, torch."""
    if use_kernel is None:
        use_kernel = router_logits.is_cuda
    if use_kernel:
        # Triton reads TRITON_INTERPRET when this is imported.
        from surge.kernels.moe_routing import route
        return route(router_logits, top_k, renormalize, dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(nn.Module):
    """This rank's experts of one layer. Expert ids arrive global; those held by another rank become -1."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        tp, ep = get_tp_group(), get_ep_group()
        if num_experts % ep.world_size:
            raise ValueError(f"num_experts={num_experts} does not split evenly over {ep.world_size} expert-parallel "
                             "ranks")
        split = tp.world_size // ep.world_size  # ranks sharing each expert (1 with expert parallelism)
        if intermediate % split:
            raise ValueError(f"moe_intermediate_size={intermediate} does not split evenly over "
                             f"tensor_parallel_size={split}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.num_local_experts = num_experts // ep.world_size
        self.expert_start = ep.rank * self.num_local_experts
        self.local_intermediate = intermediate // split
        self.intermediate_start = (tp.rank % split) * self.local_intermediate
        e, i = self.num_local_experts, self.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden), requires_grad=False)  # [gate | up] rows
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i), requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[str, int | None] | None = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in _PROJECTIONS):
            raise ValueError(f"expert shard id {shard_id!r} is not (projection, expert) with projection one of "
                             f"{', '.join(_PROJECTIONS)}")
        projection, expert = shard_id
        e0, n, i0, i = self.expert_start, self.num_local_experts, self.intermediate_start, self.local_intermediate
        if expert is None:  # every expert stacked: this rank's experts, each sliced as below
            want = ((self.num_experts, 2 * self.intermediate, self.hidden) if projection == "gate_up"
                    else (self.num_experts, self.hidden, self.intermediate))
            if tuple(loaded.shape) != want:
                raise ValueError(f"stacked experts of shape {tuple(loaded.shape)}, expected {want}")
            local = loaded.narrow(0, e0, n)
            if projection == "gate_up":
                full = self.intermediate
                param.data[:, :i].copy_(local[:, i0:i0 + i])
                param.data[:, i:].copy_(local[:, full + i0:full + i0 + i])
            else:
                param.data.copy_(local.narrow(2, i0, i))
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.num_experts})")
        if not e0 <= expert < e0 + n:
            return  # another rank's expert
        want = (self.hidden, self.intermediate) if projection == "down" else (self.intermediate, self.hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert} {projection}_proj of shape {tuple(loaded.shape)}, expected {want}")
        target = param.data[expert - e0]
        if projection == "down":
            target.copy_(loaded.narrow(1, i0, i))
        else:
            target.narrow(0, 0 if projection == "gate" else i, i).copy_(loaded.narrow(0, i0, i))

    def local_expert_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, -1 where another rank holds the expert."""
        if self.num_local_experts == self.num_experts:
            return topk_ids
        local = topk_ids - self.expert_start
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) (the caller all-reduces it)."""
        if x.is_cuda:  # the kernels skip another rank's experts themselves: no id arithmetic launched here
            from surge.kernels.fused_moe import fused_moe
            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             expert_offset=self.expert_start)
        from surge.kernels.reference import fused_moe as fused_moe_reference
        return fused_moe_reference(x, self.gate_up_proj, self.down_proj, topk_weights,
                                   self.local_expert_ids(topk_ids))


class SparseMoeBlock(nn.Module):
    """The feed-forward block of a mixture-of-experts layer: route each token to its top-k experts, combine their
    outputs weighted by the router, sum over the ranks."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts)  # the router, replicated: every rank routes every token alike
        self.experts = FusedMoE(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, self.gate.weight), self.top_k, self.norm_topk_prob, x.dtype)
        return get_tp_group().all_reduce(self.experts(x, weights, ids))
