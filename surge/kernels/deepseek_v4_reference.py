"""Plain-torch definitions of DeepSeek V4's kernels (the lightning indexer's scores and top-k, the compressor's
pooling, the mHC pre-mix), written from HF transformers' `models/deepseek_v4`: the references the Triton kernels
are tested against, and the CPU path. No Triton here."""
from __future__ import annotations

import torch

INT32_MAX = 2 ** 31 - 1


def total_order_key(x: torch.Tensor) -> torch.Tensor:
    """float -> int32 keys ordering values totally: NaN above +inf (as torch.topk ranks it), then +inf ... -inf;
    -0.0 and +0.0 equal (so they tie, and ties go to the lower index)."""
    bits = x.float().contiguous().view(torch.int32)
    key = torch.where(bits >= 0, bits, bits ^ INT32_MAX)
    key = torch.where(x == 0, torch.zeros_like(key), key)
    return torch.where(x.isnan(), torch.full_like(key, INT32_MAX), key)


def indexer_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Per row r, the indices of the min(k, L_r) largest of scores[r, :L_r] (L_r = lengths[r] clamped to
    [0, scores.shape[1]]) in the total order of `total_order_key`, ties to the lower index, listed in ascending
    index order; the row's remaining slots -1. [rows, k] int32. Row by row with a stable sort, on the CPU."""
    scores, lengths = scores.cpu(), lengths.cpu()
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for row in range(scores.shape[0]):
        length = min(max(int(lengths[row]), 0), scores.shape[1])
        key = total_order_key(scores[row, :length])
        chosen = torch.sort(key, descending=True, stable=True).indices[:min(k, length)]
        out[row, :chosen.numel()] = chosen.sort().values.to(torch.int32)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                   weights_scale: float) -> torch.Tensor:
    """HF's DeepseekV4IndexerScorer: sum over heads h of relu(q[t, h] . keys[s]) * softmax_scale *
    (weights[t, h] * weights_scale), in float32. q [T, H, D]; weights [T, H] (weights_proj's output); keys [S, D]
    (the indexer's compressed keys) -> [T, S]."""
    scores = torch.relu(torch.einsum("thd,sd->ths", q.float(), keys.float())) * softmax_scale
    return (scores * (weights.float() * weights_scale).unsqueeze(-1)).sum(dim=1)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """The compressor's entries for one sequence's tokens from position 0, as HF's DeepseekV4HCACompressor /
    DeepseekV4CSACompressor (and the indexer's own compressor) compute them, rounding step by step as they do.

    kv, gate [n, W] (kv_proj / gate_proj outputs); position_bias [rate, W] float32; W = D, or 2D with overlap (CSA):
    entry w then pools window w - 1's first half ("Ca") with window w's second half ("Cb"), 2 * rate slots, the Ca
    slots of entry 0 absent. Per channel, softmax over the slots of gate + bias (float32), the weights rounded to
    kv's dtype, weighted sum; RMSNorm (norm_weight, float32); interleaved rotary on the trailing 2 * cos.shape[-1]
    channels at position w * rate (cos, sin [n // rate, rope_dim / 2], in kv's dtype as HF rounds them). Returns
    [n // rate, D] in kv's dtype; a partial last window yields nothing."""
    n_windows = kv.shape[0] // rate
    width = kv.shape[1]
    dim = width // 2 if overlap else width
    kv = kv[:n_windows * rate].view(n_windows, rate, width)
    gate = gate[:n_windows * rate].view(n_windows, rate, width) + position_bias
    if overlap:
        slots_kv = kv.new_zeros(n_windows, 2 * rate, dim)
        slots_gate = gate.new_full((n_windows, 2 * rate, dim), float("-inf"))
        slots_kv[:, rate:], slots_gate[:, rate:] = kv[..., dim:], gate[..., dim:]
        slots_kv[1:, :rate], slots_gate[1:, :rate] = kv[:-1, :, :dim], gate[:-1, :, :dim]
        kv, gate = slots_kv, slots_gate
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    normed = pooled.float()
    normed = (norm_weight * (normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps))).to(kv.dtype)
    rope_dim = 2 * cos.shape[-1]
    nope, rope = normed[:, :dim - rope_dim], normed[:, dim - rope_dim:]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    turned = torch.stack((-rope[:, 1::2], rope[:, 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(kv.dtype)
    return torch.cat([nope, rotated], dim=-1)


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            rms_eps: float, sinkhorn_iters: int, norm_weight: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's DeepseekV4HyperConnection (then the block's input RMSNorm when norm_weight is given): streams
    [T, N, D] -> (post [T, N] float32, comb [T, N, N] float32, the collapsed streams [T, D] in streams' dtype,
    normalized when norm_weight). fn [(2 + N) * N, N * D], base [(2 + N) * N], scale [3]: the mixes are
    fn @ rms_normed(flattened streams), split into pre, post and comb (row-softmaxed, then Sinkhorn-normalized:
    columns, then sinkhorn_iters - 1 times rows and columns)."""
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    pre_w, post_w, comb_w = torch.nn.functional.linear(flat, fn.float()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    if norm_weight is not None:
        x = collapsed.float()
        collapsed = (norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps))).to(streams.dtype)
    return post, comb, collapsed


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block, as HF's DeepseekV4DecoderLayer mixes them: post[t, n] * block_out[t] +
    sum_j comb[t, j, n] * streams[t, j], in streams' dtype. block_out [T, D]; streams [T, N, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


def sparse_attention(q: torch.Tensor, kv_rows: torch.Tensor, row_table: torch.Tensor, req_of_token: torch.Tensor,
                     positions: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
                     entries: torch.Tensor | None = None, entry_table: torch.Tensor | None = None, rate: int = 0,
                     topk: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek V4's attention for each token t (as HF's DeepseekV4Attention with its sinks): q[t] [H, D] over one
    shared key-value head, the keys being the token rows of positions (p - window, p] (p = positions[t], rows through
    row_table[req_of_token[t]], kv_rows [blocks, block_size, D]) and the compressed entries w < (p + 1) // rate, all
    of them or those topk[t] lists (-1: none); entry w is row w % (block_size // rate, at least 1) of the block
    entry_table[req][(w * rate + rate - 1) // block_size]. A sink logit per head joins each softmax's denominator.
    Float32 math, [T, H, D] in q's dtype. Token by token, on the CPU."""
    block_size = kv_rows.shape[1]
    rows_per_block = max(1, block_size // rate) if rate else 1
    out = torch.empty(q.shape, dtype=q.dtype)
    for t in range(q.shape[0]):
        req, p = int(req_of_token[t]), int(positions[t])
        k_pos = torch.arange(max(0, p - window + 1), p + 1)
        keys = [kv_rows[row_table[req, k_pos // block_size].long(), k_pos % block_size]]
        if rate:
            chosen = torch.arange((p + 1) // rate) if topk is None else topk[t][topk[t] >= 0].long()
            blocks = entry_table[req, (chosen * rate + rate - 1) // block_size].long()
            keys.append(entries[blocks, chosen % rows_per_block])
        k = torch.cat(keys).float().cpu()
        scores = torch.einsum("hd,ld->hl", q[t].float().cpu(), k) * scale
        probs = torch.cat((scores, sinks.float().cpu()[:, None]), dim=1).softmax(dim=1)[:, :-1]
        out[t] = (probs @ k).to(q.dtype)
    return out
