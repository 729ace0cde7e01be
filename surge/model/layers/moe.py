"""Mixture of experts: a router (softmax over experts, top-k, optionally renormalized; or top-k, then the softmax of
those logits; or DeepSeek's grouped softmax / sigmoid routing) and the experts' gated MLPs (SiLU, or gpt-oss's
clamped SwiGLU; optionally with biases), whose weights are stacked per layer ([E, 2I, H] gate|up and [E, H, I] down)
from per-expert or stacked checkpoint tensors.

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

from surge import envs
from surge.distributed.parallel_state import get_ep_group, get_tp_group
from surge.kernels.reference import EXPERT_ACTIVATIONS
from surge.model.layers.linear import Linear, weights_deferred
from surge.model.quant.base import UNQUANTIZED_MOE, WEIGHT, MoEMethod

# Checkpoint shard ids of expert tensors: (projection, expert) for one expert's tensor, or (projection, None) for
# all experts stacked already (HF transformers 5 models in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]).
_PROJECTIONS = ("gate", "up", "down", "gate_up")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
                   use_kernel: bool | None = None, softmax_after_topk: bool = False, *,
                   scoring_func: str = "softmax", num_expert_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k]): softmax in float32 over the experts, the top k, divided by
    their sum when renormalize (norm_topk_prob), as HF transformers routes. softmax_after_topk (gpt-oss): the top k
    logits, then their softmax (in float32): renormalized weights, rounded as HF's gpt-oss router rounds them.

    DeepSeek's variants (vLLM's names), through grouped_topk: scoring_func "sigmoid" (V3), e_score_correction_bias
    (V3's noaux_tc: added to the scores to choose experts, not to weight them), num_expert_group / topk_group
    (experts in groups, only the topk_group best groups eligible), routed_scaling_factor (times the weights).

    use_kernel: None, the fused router kernel on CUDA (one launch instead of softmax, topk's sorts and the sum;
    int32 ids, ties to the lowest expert id) and torch elsewhere; True, the kernel on any device (tests, under
    TRITON_INTERPRET=1); False, torch. The DeepSeek variants route in torch on every device (no kernel yet)."""
    if (scoring_func != "softmax" or num_expert_group is not None or e_score_correction_bias is not None
            or routed_scaling_factor != 1.0):
        if softmax_after_topk:
            raise ValueError("softmax_after_topk does not combine with grouped or sigmoid routing")
        weights, ids = grouped_topk(router_logits, top_k, renormalize, scoring_func=scoring_func,
                                    num_expert_group=num_expert_group, topk_group=topk_group,
                                    e_score_correction_bias=e_score_correction_bias)
        return (weights * routed_scaling_factor).to(dtype), ids
    if use_kernel is None:
        use_kernel = router_logits.is_cuda
    if use_kernel:
        # Triton reads TRITON_INTERPRET when this is imported.
        from surge.kernels.moe_routing import route
        return route(router_logits, top_k, renormalize, dtype, softmax_after_topk)
    if softmax_after_topk:
        top_logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1).to(dtype), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring_func: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing in float32, as HF transformers' DeepseekV2/V3 routers compute it: (weights [T, k] float32,
    ids [T, k]).

    Scores: softmax (V2) or sigmoid (V3) of the logits. Choice scores: the scores, plus e_score_correction_bias
    when given. With num_expert_group, the experts form that many equal groups, each scored by its best choice score
    (V2's group_limited_greedy) or, with a correction bias, the sum of its best two (V3's noaux_tc); experts outside
    the topk_group best groups are not chosen (their choice scores 0 (V2) or -inf (V3)). The top_k choice scores
    pick the experts; their weights are the scores without the bias, divided by their sum (+ 1e-20) when
    renormalize."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func={scoring_func!r} is not supported; supported: 'softmax', 'sigmoid'")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = choice.shape
        if num_experts % num_expert_group or not 1 <= (topk_group or 0) <= num_expert_group:
            raise ValueError(f"n_group={num_expert_group} must divide the {num_experts} experts and topk_group="
                             f"{topk_group} be in [1, n_group]")
        grouped = choice.view(num_tokens, num_expert_group, -1)
        if e_score_correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, 0.0 if e_score_correction_bias is None else float("-inf"))
    if e_score_correction_bias is None:
        weights, ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)
    else:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


class FusedMoE(nn.Module):
    """This rank's experts of one layer. Expert ids arrive global; those held by another rank become -1."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, bias: bool = False,
                 activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 stacked_in_out: bool = False, interleaved_gate_up: bool = False) -> None:
        """bias: gate|up [E, 2I] and down [E, H] biases. activation: reference.EXPERT_ACTIVATIONS (swiglu_alpha and
        swiglu_limit for "swiglu_oai"). How a checkpoint's stacked tensors are laid out: stacked_in_out, [E, in, out]
        (x @ W) rather than [E, out, in]; interleaved_gate_up, gate and up alternate along the 2I axis (gpt-oss)
        rather than [gate | up]. They are stored in Surge's layout either way."""
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation={activation!r} is not supported; supported: "
                             f"{', '.join(EXPERT_ACTIVATIONS)}")
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.stacked_in_out, self.interleaved_gate_up = stacked_in_out, interleaved_gate_up
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
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: MoEMethod = UNQUANTIZED_MOE
        if not weights_deferred():  # else a quantization config gives the layer its method (surge/model/quant)
            UNQUANTIZED_MOE.create_weights(self, None)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(e, hidden), requires_grad=False)
            self.gate_up_proj_bias.weight_loader = self.bias_loader
            self.down_proj_bias.weight_loader = self.bias_loader
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def set_method(self, method: MoEMethod, device: torch.device | None) -> None:
        self.quant_method = method
        method.create_weights(self, device)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[str, int | None] | None = None) -> None:
        """One expert's gate, up or down tensor ((projection, expert)), or every expert's stacked ((projection,
        None)): this rank's experts and intermediate slice of it. A quantized parameter counts checkpoint elements
        per element along its rows and columns (its sharding: block scales, packed blocks)."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in _PROJECTIONS):
            raise ValueError(f"expert shard id {shard_id!r} is not (projection, expert) with projection one of "
                             f"{', '.join(_PROJECTIONS)}")
        projection, expert = shard_id
        sharding = getattr(param, "sharding", WEIGHT)
        row_div, col_div = sharding.out_div or 1, sharding.in_div
        e0, n = self.expert_start, self.num_local_experts
        i0, i = self.intermediate_start, self.local_intermediate
        if i0 % row_div or (col_div is not None and i0 % col_div):
            raise ValueError(f"this rank's intermediate slice starts at {i0}, not a multiple of the quantization "
                             f"block {row_div if i0 % row_div else col_div}: this split cannot hold it")
        rows = (-(-self.intermediate // row_div), -(-i // row_div), i0 // row_div)  # full, local, first
        cols = (1, 1, 0) if col_div is None else (-(-self.intermediate // col_div), -(-i // col_div), i0 // col_div)
        hidden_rows, hidden_cols = -(-self.hidden // row_div), 1 if col_div is None else -(-self.hidden // col_div)
        if expert is None:  # every expert stacked: this rank's experts, each sliced as below
            want = ((self.num_experts, 2 * rows[0], hidden_cols) if projection == "gate_up"
                    else (self.num_experts, hidden_rows, cols[0]))
            in_out = getattr(param, "checkpoint_in_out", self.stacked_in_out)
            if in_out:
                want = (want[0], want[2], want[1])
            if tuple(loaded.shape[:3]) != want or loaded.shape[3:] != param.shape[3:]:
                raise ValueError(f"stacked experts of shape {tuple(loaded.shape)}, expected {want + param.shape[3:]}")
            local = loaded.narrow(0, e0, n)
            if in_out:
                local = local.transpose(1, 2)
            experts = slice(None)
            if projection == "gate_up":
                gate, up = self._gate_and_up(local, rows[0])
                self._store(param, (experts, slice(0, rows[1])), gate.narrow(1, rows[2], rows[1]))
                self._store(param, (experts, slice(rows[1], 2 * rows[1])), up.narrow(1, rows[2], rows[1]))
            else:
                self._store(param, (experts,), local.narrow(2, cols[2], cols[1]))
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.num_experts})")
        if not e0 <= expert < e0 + n:
            return  # another rank's expert
        want = (hidden_rows, cols[0]) if projection == "down" else (rows[0], hidden_cols)
        if tuple(loaded.shape) != want:
            raise ValueError(f"expert {expert} {projection}_proj tensor of shape {tuple(loaded.shape)}, expected "
                             f"{want}")
        if projection == "down":
            self._store(param, (expert - e0,), loaded.narrow(1, cols[2], cols[1]))
        else:
            start = 0 if projection == "gate" else rows[1]
            self._store(param, (expert - e0, slice(start, start + rows[1])), loaded.narrow(0, rows[2], rows[1]))

    @staticmethod
    def _store(param: nn.Parameter, index: tuple, source: torch.Tensor) -> None:
        on_load = getattr(param, "on_load", None)
        if on_load is not None:  # a method converting as it loads (online quantization)
            return on_load(param, index, source)
        param.data[index].copy_(source)

    def _gate_and_up(self, stacked: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A checkpoint's stacked gate|up [E, 2I, ...] -> (gate, up), each [E, I, ...] (I: `rows`)."""
        if self.interleaved_gate_up:
            return stacked[:, 0::2], stacked[:, 1::2]
        rows = self.intermediate if rows is None else rows
        return stacked[:, :rows], stacked[:, rows:]

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: tuple[str, int | None] | None = None) -> None:
        """Stacked biases: ("gate_up", None) [E, 2I] or ("down", None) [E, H]. A down bias is added once per
        expert: by the rank holding the first slice of its intermediate size (zeros on the others, whose partial
        outputs the all-reduce adds)."""
        if shard_id not in (("gate_up", None), ("down", None)):
            raise ValueError(f"expert bias shard id {shard_id!r} is not ('gate_up', None) or ('down', None)")
        want = (self.num_experts, 2 * self.intermediate if shard_id[0] == "gate_up" else self.hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"stacked expert biases of shape {tuple(loaded.shape)}, expected {want}")
        local = loaded.narrow(0, self.expert_start, self.num_local_experts)
        i0, i = self.intermediate_start, self.local_intermediate
        if shard_id[0] == "gate_up":
            gate, up = self._gate_and_up(local)
            param.data[:, :i].copy_(gate[:, i0:i0 + i])
            param.data[:, i:].copy_(up[:, i0:i0 + i])
        elif i0 == 0:
            param.data.copy_(local)
        else:
            param.data.zero_()

    def local_expert_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, -1 where another rank holds the expert."""
        if self.num_local_experts == self.num_experts:
            return topk_ids
        local = topk_ids - self.expert_start
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) (the caller all-reduces it)."""
        return self.quant_method.apply(self, x, topk_weights, topk_ids, gate_up_bias=self.gate_up_proj_bias,
                                       down_bias=self.down_proj_bias, activation=self.activation,
                                       swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)


def uniform_random_routing(router_logits: torch.Tensor, top_k: int,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmarks only (SURGE_MOE_ROUTING_SIMULATION=uniform_random): k distinct experts per token drawn uniformly,
    equal weights. Random-weight models route every greedy sequence alike; this spreads a batch over the experts as
    real traffic does (vLLM's VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random, for side-by-side runs)."""
    scores = torch.rand(router_logits.shape, device=router_logits.device)
    if router_logits.is_cuda:  # the router kernel on the scores: one launch, not topk's two sorts, a cast and a fill
        from surge.kernels.moe_routing import route
        return route(scores, top_k, False, dtype, uniform_weights=True)
    ids = scores.topk(top_k, dim=-1).indices
    return torch.full(ids.shape, 1.0 / top_k, dtype=dtype, device=ids.device), ids


class SparseMoeBlock(nn.Module):
    """The feed-forward block of a mixture-of-experts layer: route each token to its top-k experts, combine their
    outputs weighted by the router, sum over the ranks."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool, *,
                 router_bias: bool = False, softmax_after_topk: bool = False, **expert_options) -> None:
        """router_bias: the router's Linear has a bias; softmax_after_topk: see select_experts; expert_options: the
        FusedMoE's keyword arguments (biases, activation, checkpoint layout)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob, self.softmax_after_topk = top_k, norm_topk_prob, softmax_after_topk
        # The router, replicated: every rank routes every token alike.
        self.gate = Linear(hidden, num_experts, bias=router_bias, quantizable=False)  # read by F.linear below
        self.experts = FusedMoE(num_experts, hidden, intermediate, **expert_options)
        self.routing_simulation = envs.SURGE_MOE_ROUTING_SIMULATION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight, self.gate.bias)
        if self.routing_simulation == "uniform_random":
            weights, ids = uniform_random_routing(logits, self.top_k, x.dtype)
        else:
            weights, ids = select_experts(logits, self.top_k, self.norm_topk_prob, x.dtype,
                                          softmax_after_topk=self.softmax_after_topk)
        return get_tp_group().all_reduce(self.experts(x, weights, ids))


def moe_kernel_keys(model: nn.Module, token_counts: list[int]) -> dict[object, list]:
    """The MoE kernels' launch keys (wrapper -> keys) for every expert block of `model` (a module with `experts`, a
    FusedMoE, and `top_k`) at each token count: its router (where it routes with the kernel: SparseMoeBlock's
    softmax routing, or the uniform routing simulation) and its fused experts, as the CUDA path dispatches them
    (int32 ids from the router kernel, int64 from torch's top-k). Computed from shapes alone: no GPU needed."""
    from surge.kernels.fused_moe import FUSED_MOE, MoeExperts
    from surge.kernels.moe_routing import ROUTER

    keys: dict[object, list] = {ROUTER: [], FUSED_MOE: []}
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, FusedMoE) or not hasattr(block, "top_k"):
            continue
        dtype, top_k, num_experts = experts.params_dtype, block.top_k, experts.num_experts
        simulated = getattr(block, "routing_simulation", None) == "uniform_random"
        router = simulated or isinstance(block, SparseMoeBlock)
        method = experts.quant_method
        if method.kernel_takes(dtype):
            gate_up, down, quant = method.kernel_weights(experts)
        else:
            (gate_up, down), quant = method.cached_dense_weights(experts), None
        for t in token_counts:
            if router:
                keys[ROUTER].append(ROUTER.dispatch(
                    num_tokens=t, num_experts=num_experts, top_k=top_k, weights_dtype=dtype,
                    logits_dtype=torch.float32 if simulated else dtype,  # the simulation routes torch.rand's
                    renormalize=not simulated and block.norm_topk_prob,
                    softmax_after_topk=not simulated and block.softmax_after_topk, uniform_weights=simulated))
            x = torch.empty(t, experts.hidden, dtype=dtype, device="meta")
            ids = torch.empty(t, top_k, dtype=torch.int32 if router else torch.int64, device="meta")
            keys[FUSED_MOE].append(FUSED_MOE.dispatch(t, MoeExperts.of(
                x, gate_up, down, torch.empty(t, top_k, dtype=dtype, device="meta"), ids, experts.expert_start,
                experts.gate_up_proj_bias, experts.down_proj_bias, experts.activation, quant)))
    return keys


def warm_up_moe_kernels(model: nn.Module, token_counts: list[int], max_workers: int) -> int:
    """Compile moe_kernel_keys' variants (the kernel warm-up's share for MoE models; CUDA only); returns how many
    were compiled."""
    return sum(kernel.compile_many(keys, max_workers=max_workers)
               for kernel, keys in moe_kernel_keys(model, token_counts).items() if keys)
