"""DeepSeek V4: shared-KV multi-query attention over a sliding window plus compressed entries (CSA: windows of 4
tokens scored by a lightning indexer that keeps index_topk of them; HCA: windows of 128, all kept), attention sinks,
a grouped low-rank output projection; hyper-connections (hc_mult residual streams mixed by Sinkhorn-normalized
matrices); mixtures of experts routed by sqrtsoftplus scores (or, in hash_moe layers, by a frozen token-id table)
with clamped SwiGLU experts and a shared expert. The math is HF transformers' (models/deepseek_v4), the references
in surge/kernels/deepseek_v4_reference.py.

KV cache (surge/attention/deepseek_v4.py): every layer caches one row per token, its key-value and in compressed
layers the compressor's per-token state, in a sliding-window group (kept while the attention's window or the
compressor's partial window reads it); compressed layers add a cache of their own per rate holding one entry per
window (and the indexer's key). Both are exact under prefix-cache hits, chunked prefill and preemption (a row depends
only on its prefix, and a window's entry is made once, from cached state, whichever step completes it). Under the
Triton backend (CUDA's) the attention and the hyper-connections run the V4 kernels over the whole batch from device
lengths (surge/attention/deepseek_v4_triton.py), so decode steps are captured in CUDA graphs; under the torch backend
(the CPU's) they run request by request in plain torch (surge/attention/deepseek_v4.py), the reference.

Checkpoint names: DeepSeek's (`layers.N.attn.wq_a`, `ffn.experts.E.w1` ...), as transformers' save_pretrained writes
them (under `model.`, with `head.weight`) and as the released checkpoints do (no prefix, `embed.weight`,
`attn.kv_norm.weight`, `hc_head_fn`); MTP layers (`mtp.*`) are skipped here, loaded by DeepseekV4MTP
(deepseek_v4_mtp.py) as the draft of speculative_config method "deepseek_mtp".

Tensor and expert parallelism: the query heads and the output groups split, the one shared key-value head and
everything that makes or reads its caches (compressors, indexer) replicated, the experts split as FusedMoE does;
DeepseekV4Attention, DeepseekV4MoE and check_parallel say why and what must divide.

Config fields the math does not read in HF either: norm_topk_prob (weights are always renormalized over the chosen
experts), n_shared_experts (one shared expert of moe_intermediate_size), num_key_value_heads (one shared head).
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from surge import envs
from surge.attention import deepseek_v4_triton as v4k
from surge.attention.backend import AttentionMetadata
from surge.attention.deepseek_v4 import (RowLayout, WindowCompressor, close_windows, entry_slots, rows_of,
                                         select_entries, sink_attention, slots_of)
from surge.core.kv_cache.spec import CompressedEntrySpec, KVCacheSpec, SlidingTokenRowSpec
from surge.distributed.parallel_state import get_tp_group
from surge.kernels.deepseek_v4_reference import mhc_post, mhc_pre
from surge.kernels.reference import rotate_interleaved
from surge.model.arch import CausalLM, WeightMapper, cfg_get, refuse, require
from surge.model.layers.attention import Attention
from surge.model.layers.embedding import VocabParallelEmbedding
from surge.model.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from surge.model.layers.moe import FusedMoE, uniform_random_routing
from surge.model.layers.rotary import RotaryEmbedding, rope_parameters

_SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}
COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")


def _fp32(*shape: int) -> nn.Parameter:
    """HF keeps norms, sinks, position biases and hyper-connection weights in float32 whatever the model's dtype."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class RMSNorm(nn.Module):
    """V4's RMSNorm: a float32 weight, multiplied in float32 and rounded once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = _fp32(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h if weight is None else weight * h).to(x.dtype)


def rope_tail(x: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved rope on the trailing rotary_dim channels of x [T, ..., D] (V4's heads are [nope | rope]);
    inverse: the conjugate rotation (-sin), which takes the output's rope slice back to relative positions."""
    cos, sin = rotary.cos_cache[positions].to(x.dtype), rotary.sin_cache[positions].to(x.dtype)
    if inverse:
        sin = -sin
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = rotary.rotary_dim
    return torch.cat((x[..., :-rd], rotate_interleaved(x[..., -rd:], cos, sin)), dim=-1)


class Compressor(nn.Module):
    """Pools windows of `rate` tokens into entries of `dim` values (overlap: CSA's two series per token)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.wkv, self.wgate = Linear(hidden, width), Linear(hidden, width)
        self.ape = _fp32(rate, width)
        self.norm = RMSNorm(dim, eps)
        self.rate, self.overlap = rate, overlap

    def params(self, rotary: RotaryEmbedding, layout: RowLayout, columns: tuple[str, str, str]) -> WindowCompressor:
        """columns: the row's state_kv, state_gate and entry columns for this compressor."""
        return WindowCompressor(self.ape, self.norm.weight, self.norm.eps, rotary.cos_cache, rotary.sin_cache,
                                *(layout.column(c) for c in columns))


class Indexer(nn.Module):
    """The lightning indexer: its own compressor at index_head_dim, queries from the attention's low-rank q."""

    def __init__(self, tc, rate: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = tc.index_n_heads, tc.index_head_dim, tc.index_topk
        self.wq_b = Linear(tc.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(tc.hidden_size, self.num_heads)
        self.compressor = Compressor(tc.hidden_size, self.head_dim, rate, True, tc.rms_norm_eps)


def _v4_cache_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ValueError(f"kv_cache_dtype={str(dtype).removeprefix('torch.')} is not supported for DeepSeek V4 "
                         "layers yet; use kv_cache_dtype='auto'")
    return dtype


class TokenRows(Attention):
    """Binds a V4 layer's token rows (the runner allocates them by the spec declared here); attends nowhere itself.
    Its group's window covers the attention's and the compressor's partial window."""

    def __init__(self, num_heads: int, head_dim: int, sliding_window: int, layout: RowLayout, scale: float) -> None:
        super().__init__(num_heads, 1, head_dim, sliding_window, scale=scale)
        self.params = dataclasses.replace(self.params, has_sinks=True, host_path=True, device_path=True)
        self.layout = layout

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return SlidingTokenRowSpec(block_size, 1, self.layout.width, _v4_cache_dtype(dtype),
                                   sliding_window=max(self.sliding_window, self.layout.state_window()))


class EntryRows(Attention):
    """Binds a compressed layer's entry rows: one per window of layout.rate tokens, every one kept."""

    def __init__(self, num_heads: int, head_dim: int, layout: RowLayout, scale: float) -> None:
        super().__init__(num_heads, 1, head_dim, scale=scale)
        self.params = dataclasses.replace(self.params, has_sinks=True, host_path=True, device_path=True)
        self.layout = layout

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return CompressedEntrySpec(block_size, 1, self.layout.entry_width, _v4_cache_dtype(dtype),
                                   compress_rate=self.layout.rate)


def _rank_slice(rank: int, world_size: int, size: int):
    """A weight loader keeping rows [rank * size, (rank + 1) * size) of a per-head checkpoint tensor."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape) != (world_size * size,):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}, expected ({world_size * size},) "
                             f"(this rank's {size} rows at {rank * size})")
        param.data.copy_(loaded.narrow(0, rank * size, size))
    return load


class DeepseekV4Attention(nn.Module):
    """Tensor parallelism (check_parallel refuses what does not split): each rank keeps num_attention_heads / tp
    query heads (wq_b's rows, their sinks) and o_groups / tp output groups, the groups holding exactly those heads'
    channels (wo_a's group-major rows, wo_b's input columns; one all-reduce, in wo_b). Replicated: the low-rank query
    (wq_a, q_norm: every head and the indexer read all of it), the one shared key-value head (wkv, norm) and its token
    rows, the compressors and their entries (they pool that one head), and the indexer: its top-k needs every index
    head's score summed, so a split would add an all-reduce of [tokens, entries] scores per layer, and a replicated one
    makes the same choice on every rank without any."""

    def __init__(self, tc, layer_type: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads, d, eps = tc.hidden_size, tc.num_attention_heads, tc.head_dim, tc.rms_norm_eps
        tp = get_tp_group()
        self.num_heads, self.head_dim, self.eps, self.window = heads // tp.world_size, d, eps, tc.sliding_window
        self.groups, self.o_rank = tc.o_groups // tp.world_size, tc.o_lora_rank
        if heads * d % tc.o_groups:
            raise ValueError(f"config field o_groups={tc.o_groups} must divide num_attention_heads * head_dim = "
                             f"{heads * d}")
        self.wq_a = Linear(hidden, tc.q_lora_rank)
        self.q_norm = RMSNorm(tc.q_lora_rank, eps)
        self.wq_b = ColumnParallelLinear(tc.q_lora_rank, heads * d)
        self.wkv = Linear(hidden, d)
        self.norm = RMSNorm(d, eps)
        self.wo_a = ColumnParallelLinear(heads * d // tc.o_groups, tc.o_groups * self.o_rank)
        self.wo_b = RowParallelLinear(tc.o_groups * self.o_rank, hidden)
        self.attn_sink = _fp32(self.num_heads)
        self.attn_sink.weight_loader = _rank_slice(tp.rank, tp.world_size, self.num_heads)
        self.rotary = rotary
        self.rate = tc.compress_rates[layer_type] if layer_type != "sliding_attention" else 0
        csa = layer_type == "compressed_sparse_attention"
        if self.rate:
            self.compressor = Compressor(hidden, d, self.rate, csa, eps)
        self.indexer = Indexer(tc, self.rate) if csa else None
        layout = RowLayout(d, self.rate, csa, tc.index_head_dim if csa else 0)
        self.attn = TokenRows(self.num_heads, d, self.window, layout, d ** -0.5)
        self.entries = EntryRows(self.num_heads, d, layout, d ** -0.5) if self.rate else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: list[AttentionMetadata]) -> torch.Tensor:
        q_res = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(q_res).view(-1, self.num_heads, self.head_dim), None, self.eps)
        q = rope_tail(q, self.rotary, positions)
        layout = self.attn.layout
        # The token rows' columns, in layout order: the shared key-value, the compressors' state.
        row = {"kv": rope_tail(self.norm(self.wkv(x)), self.rotary, positions)}
        if self.rate:
            row.update(state_kv=self.compressor.wkv(x), state_gate=self.compressor.wgate(x))
        index = None
        if self.indexer is not None:
            ic = self.indexer.compressor
            row.update(index_kv=ic.wkv(x), index_gate=ic.wgate(x))
            index_q = self.indexer.wq_b(q_res).view(-1, self.indexer.num_heads, self.indexer.head_dim)
            index = (rope_tail(index_q, self.rotary, positions), self.indexer.weights_proj(x))
        kernels = self.attn.backend.deepseek_v4_kernels(x.device)
        if kernels is None:
            out = self._attend_host(positions, q, row, index, meta)
        else:
            out = self._attend_kernels(kernels, positions, q, torch.cat([row[c] for c in layout.token_columns()], -1),
                                       index, meta)
        out = rope_tail(out, self.rotary, positions, inverse=True)
        grouped = out.view(-1, self.groups, self.num_heads * self.head_dim // self.groups)
        w = self.wo_a.weight.view(self.groups, self.o_rank, -1)  # block-diagonal: one [o_rank, in] block a group
        grouped = torch.einsum("tgi,gri->tgr", grouped, w)
        return self.wo_b(grouped.flatten(1))

    def _compressors(self) -> list[tuple[Compressor, tuple[str, str, str]]]:
        """Each compressor with its state columns and entry column (the indexer's after the attention's)."""
        out = [(self.compressor, ("state_kv", "state_gate", "entry"))] if self.rate else []
        if self.indexer is not None:
            out.append((self.indexer.compressor, ("index_kv", "index_gate", "index_entry")))
        return out

    def _attend_kernels(self, kernels, positions, q, row, index, meta) -> torch.Tensor:
        """The batched path (surge/attention/deepseek_v4_triton.py): device lengths only, graph-capturable."""
        m, layout = meta[self.attn.group_id], self.attn.layout
        rows = v4k.token_rows(self.attn.kv_cache)
        block_size = rows.shape[1]
        step = v4k.StepTokens.of(m, positions)
        v4k.write_rows(rows, step, row)
        entries = entry_table = topk = None
        if self.rate:
            em = meta[self.entries.group_id]
            entries, entry_table = v4k.token_rows(self.entries.kv_cache), em.block_table
            closing = v4k.ClosingWindows.of(step, entry_table, self.rate, block_size)
            for comp, columns in self._compressors():
                v4k.pool_windows(kernels, rows, entries, m, closing, comp.params(self.rotary, layout, columns),
                                 self.rate, comp.overlap)
        if index is not None:
            capacity = self.rotary.cos_cache.shape[0] // self.rate  # max_model_len's windows
            topk = v4k.select_topk(kernels, index[0], index[1], entries[..., layout.column("index_entry")],
                                   entry_table, step, self.rate, block_size, capacity, self.indexer.topk)
        return kernels.attention(q, rows[..., layout.column("kv")], m.block_table, step.req, positions,
                                 self.attn_sink, scale=self.attn.scale, window=self.window,
                                 entries=None if entries is None else entries[..., layout.column("entry")],
                                 entry_table=entry_table, rate=self.rate, topk=topk)

    def _attend_host(self, positions, q, row, index, meta) -> torch.Tensor:
        """The host path (surge/attention/deepseek_v4.py): request by request from the step's host lengths."""
        m, layout = meta[self.attn.group_id], self.attn.layout
        rows, block_size = rows_of(self.attn.kv_cache), self.attn.kv_cache.shape[2]
        for column, value in row.items():
            rows[m.slot_mapping, layout.column(column)] = value
        entries = em = None
        if self.rate:
            entries, em = rows_of(self.entries.kv_cache), meta[self.entries.group_id]
            for comp, columns in self._compressors():
                close_windows(rows, entries, m, em, block_size, self.rate, comp.overlap,
                              comp.params(self.rotary, layout, columns))
        out = torch.empty_like(q)
        qsl = m.query_start_loc
        for r in range(m.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            if end > start:
                out[start:end] = self._attend(
                    rows, m.block_table[r], entries, em.block_table[r] if self.rate else None, m.seq_lens[r],
                    q[start:end], block_size, None if index is None else (index[0][start:end], index[1][start:end]))
        return out

    def _attend(self, rows, table, entries, entry_table, seq_len: int, q, block_size: int, index) -> torch.Tensor:
        """One request's n queries (the last n positions of its seq_len)."""
        layout, device = self.attn.layout, q.device
        n = q.shape[0]
        q_pos = torch.arange(seq_len - n, seq_len, device=device)
        k_pos = torch.arange(max(0, seq_len - n - self.window + 1), seq_len, device=device)
        keys = rows[slots_of(table, k_pos, block_size), layout.column("kv")]
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - self.window)
        count = seq_len // self.rate if self.rate else 0
        if count:
            slots = entry_slots(entry_table, torch.arange(count, device=device), self.rate, block_size)
            complete = (q_pos + 1) // self.rate  # windows complete at each query
            seen = torch.arange(count, device=device)[None, :] < complete[:, None]
            if index is not None:
                index_keys = entries[slots, layout.column("index_entry")]
                seen &= select_entries(index[0], index[1], index_keys, complete, self.indexer.topk)
            keys = torch.cat((keys, entries[slots, layout.column("entry")]))
            visible = torch.cat((visible, seen), dim=1)
        return sink_attention(q, keys, visible, self.attn_sink, self.attn.scale)


class SharedExpert(nn.Module):
    """Split like a dense MLP (the clamps are per intermediate channel): w1 and w3's rows, w2's columns. Its output
    is this rank's partial sum, which DeepseekV4MoE adds to the routed experts' before their one all-reduce."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w3 = ColumnParallelLinear(hidden, intermediate), ColumnParallelLinear(hidden, intermediate)
        self.w2 = RowParallelLinear(intermediate, hidden, reduce_results=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x).clamp(max=self.limit)) * self.w3(x).clamp(-self.limit, self.limit))


class DeepseekV4MoE(nn.Module):
    """Routed experts (scores by scoring_func; the top num_experts_per_tok of score + correction bias, or the
    token's row of tid2eid in a hash layer; weights renormalized, times routed_scaling_factor) plus a shared one.
    The router and the hash table are replicated (every rank routes every token alike); the routed experts split as
    FusedMoE does (a slice of each, or whole experts with expert parallelism); their partial sums and the shared
    expert's are all-reduced once."""

    def __init__(self, tc, hashed: bool) -> None:
        super().__init__()
        num_experts, hidden, limit = tc.n_routed_experts, tc.hidden_size, float(tc.swiglu_limit)
        self.top_k, self.hashed = tc.num_experts_per_tok, hashed
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, n_routed_experts={num_experts}]")
        self.score = _SCORES[require(tc, "scoring_func", tuple(_SCORES))]
        self.scaling = float(tc.routed_scaling_factor)
        self.gate = Linear(hidden, num_experts, quantizable=False)
        if hashed:  # int64 in the checkpoint; this default spreads tokens for dummy weights
            table = (torch.arange(tc.vocab_size)[:, None] * self.top_k + torch.arange(self.top_k)) % num_experts
            self.gate.register_buffer("tid2eid", table.to(torch.get_default_device()))
            self.gate.tid2eid.weight_loader = _copy_buffer
        else:
            self.gate.e_score_correction_bias = _fp32(num_experts)  # it chooses experts, it does not weight them
        self.experts = FusedMoE(num_experts, hidden, tc.moe_intermediate_size, activation="silu_clamped",
                                swiglu_limit=limit)
        self.shared_experts = SharedExpert(hidden, tc.moe_intermediate_size, limit)
        self.routing_simulation = envs.SURGE_MOE_ROUTING_SIMULATION  # benchmarks: as SparseMoeBlock

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = self.score(F.linear(x, self.gate.weight))
        if self.routing_simulation == "uniform_random":  # hash layers too: their table is random weights as well
            weights, ids = uniform_random_routing(scores, self.top_k, x.dtype)
            return get_tp_group().all_reduce(self.experts(x, weights * self.scaling, ids) + self.shared_experts(x))
        if self.hashed:
            ids = self.gate.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return get_tp_group().all_reduce(self.experts(x, weights, ids) + self.shared_experts(x))


def _copy_buffer(buffer: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    if loaded.shape != buffer.shape:
        raise ValueError(f"tid2eid of shape {tuple(loaded.shape)}, expected {tuple(buffer.shape)}")
    buffer.copy_(loaded)


class DeepseekV4Layer(nn.Module):
    """layer_type: one of layer_types' values; mlp_type: one of mlp_layer_types'."""

    def __init__(self, tc, layer_type: str, mlp_type: str, rotaries: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        n, hidden = tc.hc_mult, tc.hidden_size
        self.attn = DeepseekV4Attention(tc, layer_type, rotaries["main" if layer_type == "sliding_attention"
                                                                 else "compress"])
        self.ffn = DeepseekV4MoE(tc, mlp_type == "hash_moe")
        self.attn_norm, self.ffn_norm = RMSNorm(hidden, tc.rms_norm_eps), RMSNorm(hidden, tc.rms_norm_eps)
        mixes = (2 + n) * n
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", _fp32(mixes, n * hidden))
            setattr(self, f"hc_{site}_base", _fp32(mixes))
            setattr(self, f"hc_{site}_scale", _fp32(3))
        self.hc = dict(hc_eps=tc.hc_eps, rms_eps=tc.rms_norm_eps, sinkhorn_iters=tc.hc_sinkhorn_iters)

    def forward(self, positions, streams: torch.Tensor, input_ids, meta) -> torch.Tensor:
        """streams [T, hc_mult, hidden]: each block reads their mix and adds its output back to each stream."""
        pre, post_mix = mhc_pre, mhc_post
        kernels = self.attn.attn.backend.deepseek_v4_kernels(streams.device)
        if kernels is not None:  # the attention's backend runs V4's kernels: the mixes too
            from surge.kernels.mhc import mhc_post as post_mix
            pre = kernels.mhc
        post, comb, x = pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                            norm_weight=self.attn_norm.weight, **self.hc)
        streams = post_mix(self.attn(positions, x, meta), streams, post, comb)
        post, comb, x = pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                            norm_weight=self.ffn_norm.weight, **self.hc)
        return post_mix(self.ffn(x, input_ids), streams, post, comb)


class HyperHead(nn.Module):
    """The streams' final collapse: sigmoid weights (+ hc_eps) from the RMS-normed streams."""

    def __init__(self, n: int, hidden: int, hc_eps: float, rms_eps: float) -> None:
        super().__init__()
        self.hc_fn, self.hc_base, self.hc_scale = _fp32(n, n * hidden), _fp32(n), _fp32(1)
        self.hc_eps, self.rms_eps = hc_eps, rms_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_norm(streams.flatten(1).float(), None, self.rms_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def make_rotaries(tc, max_model_len: int) -> dict[str, RotaryEmbedding]:
    """The sliding layers' rope ("main") and the compressed layers' ("compress"), as DeepseekV4Layer reads them."""
    return {kind: RotaryEmbedding(tc.head_dim, max_model_len, rope_parameters(tc, kind), interleaved=True)
            for kind in ("main", "compress")}


_EXPERT = re.compile(r"^(?P<prefix>layers\.\d+\.ffn\.experts)\.(?P<expert>\d+)\.w(?P<w>[123])\.weight$")


class DeepseekV4ForCausalLM(CausalLM):
    weight_mapper = WeightMapper(
        prefixes=(("model.", ""),),
        renames=((r"^embed\.", "embed_tokens."), (r"^head\.", "lm_head."), (r"^hc_head_(fn|base|scale)$",
                                                                            r"hc_head.hc_\1"),
                 (r"\.attn\.kv_norm\.", ".attn.norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias")),
        skip=(r"^(model\.)?mtp\.",))

    def __init__(self, config, quant_config=None) -> None:
        super().__init__(config, quant_config)
        tc = self.tc
        self.check_config(tc)
        hidden = tc.hidden_size
        self.embed_tokens = VocabParallelEmbedding(tc.vocab_size, hidden)
        rotaries = make_rotaries(tc, config.max_model_len)
        self.rotary_main, self.rotary_compress = rotaries["main"], rotaries["compress"]
        self.layers = nn.ModuleList(DeepseekV4Layer(tc, tc.layer_types[i], tc.mlp_layer_types[i], rotaries)
                                    for i in range(tc.num_hidden_layers))
        self.hc_head = HyperHead(tc.hc_mult, hidden, tc.hc_eps, tc.rms_norm_eps)
        self.norm = RMSNorm(hidden, tc.rms_norm_eps)
        self.lm_head = self.make_lm_head(self.embed_tokens)

    @staticmethod
    def check_config(tc) -> None:
        require(tc, "hidden_act", ("silu",))
        for name in ("attention_bias", "mlp_bias"):
            require(tc, name, (False,), False)
        if cfg_get(tc, "quantization_config") is not None:
            raise refuse("quantization_config", tc.quantization_config, "none (an unquantized checkpoint)")
        if cfg_get(tc, "rope_parameters", {}).get("main", {}).get("rope_type", "default") != "default":
            raise refuse("rope_parameters.main.rope_type", tc.rope_parameters["main"]["rope_type"], "'default'")
        rates = tc.compress_rates
        for kind in set(tc.layer_types) & set(COMPRESSED_LAYER_TYPES):
            if not (isinstance(rates.get(kind), int) and rates[kind] > 0):
                raise refuse(f"compress_rates.{kind}", rates.get(kind), "a positive integer")
        if not (isinstance(tc.sliding_window, int) and tc.sliding_window > 0):
            raise refuse("sliding_window", tc.sliding_window, "a positive integer")
        if tc.hc_mult < 1 or tc.hc_sinkhorn_iters < 1:
            raise ValueError(f"config fields hc_mult={tc.hc_mult} and hc_sinkhorn_iters={tc.hc_sinkhorn_iters} "
                             "must be >= 1")

    @classmethod
    def check_parallel(cls, config, parallel) -> None:
        """What splits (DeepseekV4Attention, SharedExpert, DeepseekV4MoE say how) must split evenly: the query heads,
        the output groups (each rank's groups hold its heads' channels), the shared expert; the routed experts as
        CausalLM's check says. The rest (the shared key-value head, compressors, indexer, hyper-connections, router)
        is replicated."""
        tp, tc = parallel.tensor_parallel_size, config.text_config
        for name in ("num_attention_heads", "o_groups", "moe_intermediate_size"):
            if getattr(tc, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}="
                                 f"{getattr(tc, name)}")
        super().check_parallel(config, parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden state handed out is the last layer's streams, flattened [T, hc_mult * hidden]: the head
        collapses them (compute_logits), as DeepSeek's does, and an MTP draft reads them whole (deepseek_v4_mtp.py)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = x.unsqueeze(1).expand(-1, self.tc.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids, meta)
        return streams.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(self.norm(self.hc_head(hidden.view(hidden.shape[0], self.tc.hc_mult, -1))))

    def warm_up_kernels(self, backend, device: torch.device, block_size: int, max_workers: int) -> int:
        """The batched path's kernels (compressor, indexer scores and top-k, sparse attention, mHC), one variant per
        distinct layer shape: none depends on the batch, so the capture sizes need nothing more. CUDA only (Triton's
        interpreter compiles nothing)."""
        kernels = backend.deepseek_v4_kernels(device)
        if kernels is None or device.type != "cuda":
            return 0
        keys = self.kernel_keys(kernels, block_size)
        return sum(kernel.compile_many(ks, max_workers=max_workers) for kernel, ks in keys.items() if ks)

    def kernel_keys(self, kernels, block_size: int) -> dict[object, list]:
        """Each V4 kernel's launch keys for this model's layers (kernels: a DeepseekV4Kernels)."""
        tc, dtype = self.tc, self.embed_tokens.weight.dtype
        keys: dict[object, list] = {k: [] for k in (kernels.compressor, kernels.scores, kernels.topk,
                                                    kernels.attention, kernels.mhc)}
        for layer in self.layers:
            attn = layer.attn
            keys[kernels.attention].append(kernels.attention.dispatch(
                num_heads=attn.num_heads, head_dim=attn.head_dim, window=attn.window, block_size=block_size,
                rate=attn.rate, topk=attn.indexer.topk if attn.indexer is not None else 0, dtype=dtype))
            for comp, _ in attn._compressors():
                keys[kernels.compressor].append(kernels.compressor.dispatch(
                    rate=attn.rate, head_dim=comp.norm.weight.shape[0], rope_dim=attn.rotary.rotary_dim,
                    overlap=comp.overlap, state_block=block_size, dtype=dtype))
            if attn.indexer is not None:
                capacity = attn.rotary.cos_cache.shape[0] // attn.rate
                keys[kernels.scores].append(kernels.scores.dispatch(
                    num_heads=attn.indexer.num_heads, head_dim=attn.indexer.head_dim,
                    cache_block=max(1, block_size // attn.rate), max_len=capacity, dtype=dtype, row_seq=True))
                keys[kernels.topk].append(kernels.topk.dispatch(max_len=capacity, k=attn.indexer.topk))
        keys[kernels.mhc].append(kernels.mhc.dispatch(hc_mult=tc.hc_mult, hidden_size=tc.hidden_size,
                                                      sinkhorn_iters=tc.hc_sinkhorn_iters, dtype=dtype))
        return keys

    def checkpoint_name_to_param(self, name: str):
        mapped = super().checkpoint_name_to_param(name)
        if mapped is None:
            return None
        m = _EXPERT.match(mapped[0])
        if m is None:
            return mapped
        proj = {"1": "gate", "2": "down", "3": "up"}[m["w"]]
        param = "down_proj" if proj == "down" else "gate_up_proj"
        return f"{m['prefix']}.{param}", (proj, int(m["expert"]))
