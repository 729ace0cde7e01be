"""DeepSeek V2 (and V2-Lite) and V3: multi-head latent attention (MLA) over a latent KV cache, and mixtures of
experts with shared experts and DeepSeek's routing; the first first_k_dense_replace layers (and those off
moe_layer_freq) keep a dense MLP.

Attention: q from q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when q_lora_rank is set; kv_a_proj_with_mqa gives
the latent (through kv_a_layernorm) and one rope key shared by every head; rope on the last qk_rope_head_dim channels
of each query head and on that key, GPT-J interleaved (V2 always; V3 unless rope_interleave is false; HF's
de-interleaved output is a permutation of the same channels in q and k alike, so the scores are the same). The
cache holds the latent and the rotated key (MLAAttention); kv_b_proj's weight expands or absorbs them. Softmax scale
qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2 for a scaled rope, as HF computes it. The
latent's and the query's low-rank norms use eps 1e-6 whatever rms_norm_eps says (as HF and DeepSeek's code do).

Routing: V2 softmax top-k, optionally within the topk_group best of n_group groups (topk_method
"group_limited_greedy"); V3 sigmoid scores plus e_score_correction_bias choosing among the topk_group best groups
(noaux_tc), weights renormalized per norm_topk_prob. Both times routed_scaling_factor, plus the shared experts.

Tensor parallelism splits the heads (q, kv_b_proj's rows, o_proj's columns); the latent projection and the latent
cache are replicated: every head reads the whole latent, so a split latent would cost an all-gather per layer, and
the cache is 576 values a token however many ranks. MTP layers (num_nextn_predict_layers, checkpoint layers from
num_hidden_layers on) are not the target's: skipped here, loaded by DeepseekMTP (deepseek_mtp.py) as the draft of
speculative_config method "deepseek_mtp".
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge import envs
from surge.distributed.parallel_state import get_tp_group
from surge.model.arch import WeightMapper, cfg_get, refuse, require
from surge.model.layers.attention import MLAAttention
from surge.model.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from surge.model.layers.moe import FusedMoE, select_experts, uniform_random_routing
from surge.model.layers.norm import RMSNorm
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters
from surge.model.models.llama import MLP, LlamaForCausalLM
from surge.model.models.qwen3_moe import expert_param

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF's and DeepSeek's default, not rms_norm_eps


def softmax_scale(tc) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 for a scaled rope with mscale_all_dim (HF's yarn_apply_mscale)."""
    scale = (tc.qk_nope_head_dim + tc.qk_rope_head_dim) ** -0.5
    params = rope_parameters(tc)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


class DeepseekAttention(nn.Module):
    def __init__(self, tc, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, total_heads = tc.hidden_size, tc.num_attention_heads
        self.nope, self.rope, self.v_head_dim = tc.qk_nope_head_dim, tc.qk_rope_head_dim, tc.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = tc.kv_lora_rank, cfg_get(tc, "q_lora_rank")
        qk_head_dim = self.nope + self.rope
        bias = bool(cfg_get(tc, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)  # replicated
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        # Read as a weight by the attention (expanded or absorbed), so never quantized.
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.nope + self.v_head_dim),
                                              quantizable=False)
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias)
        self.num_heads = total_heads // get_tp_group().world_size
        self.rotary = rotary
        self.attn = MLAAttention(self.num_heads, self.nope, self.rope, self.v_head_dim, self.kv_lora_rank,
                                 softmax_scale(tc))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary(positions, q[..., self.nope:].contiguous(), k_pe.unsqueeze(1).contiguous())
        q = torch.cat((q[..., :self.nope], q_pe), dim=-1)
        kv_b = self.kv_b_proj.quant_method.cached_dense_weight(self.kv_b_proj)  # read directly: dequantized once
        out = self.attn(q, kv_c, k_pe.squeeze(1), kv_b, meta)
        return self.o_proj(out.flatten(1))


class DeepseekMoE(nn.Module):
    """Routed experts (DeepSeek's routing) plus the shared experts, which run on every token."""

    def __init__(self, tc, *, scoring_func: str, correction_bias: bool, renormalize: bool,
                 n_group: int | None, topk_group: int | None) -> None:
        super().__init__()
        num_experts, hidden = tc.n_routed_experts, tc.hidden_size
        self.top_k = tc.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, n_routed_experts={num_experts}]")
        self.routing = dict(scoring_func=scoring_func, num_expert_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=float(cfg_get(tc, "routed_scaling_factor", 1.0)))
        self.renormalize = renormalize
        self.gate = Linear(hidden, num_experts, quantizable=False)  # replicated: every rank routes every token
        if correction_bias:  # HF keeps it in float32, as the routing computes
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.experts = FusedMoE(num_experts, hidden, tc.moe_intermediate_size)
        self.routing_simulation = envs.SURGE_MOE_ROUTING_SIMULATION  # benchmarks: as SparseMoeBlock
        shared = cfg_get(tc, "n_shared_experts", 0)
        self.shared_experts = (MLP(hidden, tc.moe_intermediate_size * shared, bool(cfg_get(tc, "mlp_bias", False)))
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())  # in float32, as HF routes
        if self.routing_simulation == "uniform_random":
            weights, ids = uniform_random_routing(logits, self.top_k, x.dtype)
        else:
            weights, ids = select_experts(logits, self.top_k, self.renormalize, x.dtype,
                                          e_score_correction_bias=getattr(self.gate, "e_score_correction_bias", None),
                                          **self.routing)
        out = get_tp_group().all_reduce(self.experts(x, weights, ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    weight_mapper = WeightMapper(packed={"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})
    rope_interleaved_default = True  # V2's rope is always interleaved (HF applies it as complex pairs)

    def __init__(self, config, quant_config=None) -> None:
        tc = config.text_config
        require(tc, "hidden_act", ("silu",))  # the fused experts compute SiLU
        self.check_routing(tc)
        super().__init__(config, quant_config)
        # MTP layers follow the decoder's in the checkpoint (model.layers.<num_hidden_layers + i>): the draft's.
        num_mtp = int(cfg_get(tc, "num_nextn_predict_layers", 0))
        if num_mtp:
            mtp = "|".join(str(tc.num_hidden_layers + i) for i in range(num_mtp))
            self.weight_mapper = self.weight_mapper.extend(skip=(rf"^model\.layers\.({mtp})\.",))

    @classmethod
    def check_routing(cls, tc) -> None:
        method = require(tc, "topk_method", ("greedy", "group_limited_greedy"), "greedy")
        require(tc, "scoring_func", ("softmax",), "softmax")
        if cfg_get(tc, "norm_topk_prob", False):  # HF's V2 ignores it; DeepSeek's code skips the scaling then
            raise refuse("norm_topk_prob", True, "False for DeepseekV2ForCausalLM (no released V2 config sets it)")
        if method == "group_limited_greedy":
            cls.check_groups(tc)

    @staticmethod
    def check_groups(tc) -> None:
        n_group, topk_group, num_experts = cfg_get(tc, "n_group"), cfg_get(tc, "topk_group"), tc.n_routed_experts
        if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group:
            raise ValueError(f"config field n_group={n_group!r} must be a positive divisor of n_routed_experts="
                             f"{num_experts}")
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(f"config field topk_group={topk_group!r} must be in [1, n_group={n_group}]")

    def routing(self) -> dict:
        grouped = cfg_get(self.tc, "topk_method", "greedy") == "group_limited_greedy"
        return dict(scoring_func="softmax", correction_bias=False, renormalize=False,
                    n_group=self.tc.n_group if grouped else None, topk_group=self.tc.topk_group if grouped else None)

    @classmethod
    def check_parallel(cls, config, parallel) -> None:
        super().check_parallel(config, parallel)
        tp, tc = parallel.tensor_parallel_size, config.text_config
        if tc.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's num_attention_heads="
                             f"{tc.num_attention_heads}")
        shared = tc.moe_intermediate_size * (cfg_get(tc, "n_shared_experts", 0))
        if shared % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the shared experts' size "
                             f"moe_intermediate_size * n_shared_experts={shared}")

    def make_rotary(self, layer_type: str) -> RotaryEmbedding:
        interleaved = bool(cfg_get(self.tc, "rope_interleave", self.rope_interleaved_default))
        return RotaryEmbedding(self.tc.qk_rope_head_dim, self.config.max_model_len, rope_parameters(self.tc),
                               interleaved=interleaved)

    def make_attention(self, layer_index: int, sliding_window: int | None, rotary) -> nn.Module:
        if sliding_window is not None:
            raise refuse("sliding_window", sliding_window, "None for MLA layers")
        return DeepseekAttention(self.tc, rotary)

    def make_mlp(self, layer_index: int) -> nn.Module:
        tc = self.tc
        freq = int(cfg_get(tc, "moe_layer_freq", 1))
        if (cfg_get(tc, "n_routed_experts") and layer_index >= int(cfg_get(tc, "first_k_dense_replace", 0))
                and layer_index % freq == 0):
            return DeepseekMoE(tc, **self.routing())
        return MLP(tc.hidden_size, tc.intermediate_size, bool(cfg_get(tc, "mlp_bias", False)))

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        if self.weight_mapper.map(name) is None:  # skipped (MTP layers' experts included)
            return None
        return expert_param(name) or super().checkpoint_name_to_param(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    rope_interleaved_default = True  # rope_interleave: HF's default

    @classmethod
    def check_routing(cls, tc) -> None:
        require(tc, "topk_method", ("noaux_tc",), "noaux_tc")
        require(tc, "scoring_func", ("sigmoid",), "sigmoid")
        cls.check_groups(tc)

    def routing(self) -> dict:
        return dict(scoring_func="sigmoid", correction_bias=True,
                    renormalize=bool(cfg_get(self.tc, "norm_topk_prob", False)), n_group=self.tc.n_group,
                    topk_group=self.tc.topk_group)
