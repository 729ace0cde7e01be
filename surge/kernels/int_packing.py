"""The one packed-integer weight layout the int GEMM reads (compressed-tensors pack-quantized), and converters into it
from compressed-tensors' packed zero points, AutoAWQ (GEMM) and GPTQ checkpoints. Plain torch, run once at load.

Canonical layout of a linear W [N out, K in] quantized with `bits` (4 or 8) in groups of `group_size` along K:
- weight_packed int32 [N, K * bits / 32]: value k of row n at bits [(k % p) * bits, ...) of word k // p, p = 32 / bits,
  stored unsigned (compressed-tensors stores q + 2^(bits-1));
- weight_scale [N, K / group_size] (the activation dtype);
- zero_point uint8 [N, K / group_size], unsigned like the weights, or None (symmetric: 2^(bits-1));
- input_perm int32 [K] or None: GPTQ act-order; the GEMM reads x[:, input_perm] (see gptq_to_canonical).
W[n, k] = (u[n, k] - zero[n, k // group]) * scale[n, k // group].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.quant_reference import pack_int32, unpack_int32

# AutoAWQ packs eight 4-bit columns 8c..8c+7 of a row into word c, column 8c + AWQ_PACK_ORDER[i] at nibble i.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class PackedIntWeight:
    weight_packed: torch.Tensor  # int32 [N, K * bits / 32]
    weight_scale: torch.Tensor  # [N, K / group_size]
    zero_point: torch.Tensor | None  # uint8 [N, K / group_size]; None: symmetric
    input_perm: torch.Tensor | None  # int32 [K]; None: x's columns in order
    bits: int
    group_size: int


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: the int GEMM reads 4- or 8-bit weights")


def unpack_ct_zero_point(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """compressed-tensors' asymmetric `weight_zero_point` int32 [ceil(N * bits / 32), K / group] (packed along N,
    each stored as zp + 2^(bits-1)) -> the canonical uint8 [N, K / group]."""
    _check_bits(bits)
    return unpack_int32(packed.t(), bits, out_features).t().contiguous()


def unpack_awq(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """AutoAWQ int32 [R, C / 8] (qweight or qzeros) -> uint8 [R, C] in column order."""
    nibbles = unpack_int32(packed, 4, packed.shape[-1] * 8).unflatten(-1, (-1, 8))  # [R, C / 8, nibble]
    order = torch.tensor(AWQ_PACK_ORDER, device=packed.device)
    by_column = torch.empty_like(nibbles)
    by_column[..., order] = nibbles  # nibble i holds column AWQ_PACK_ORDER[i]
    return by_column.flatten(-2)[..., :columns]


def repack_awq_qweight(qweight: torch.Tensor, columns: int) -> torch.Tensor:
    """AutoAWQ qweight int32 [K, N / 8] (N = columns) -> the canonical weight_packed int32 [N, K / 8]."""
    return pack_int32(unpack_awq(qweight, columns).t(), 4)


def awq_to_canonical(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                     group_size: int) -> PackedIntWeight:
    """AutoAWQ GEMM (4-bit): qweight int32 [K, N / 8] and qzeros int32 [K / group, N / 8] packed along N in
    AWQ_PACK_ORDER, scales [K / group, N]; W[n, k] = (w - z) * s with unsigned w and z. No zeros (zero_point false
    in the config): symmetric around 8."""
    in_features, out_features = qweight.shape[0], scales.shape[1]
    zero = None if qzeros is None else unpack_awq(qzeros, out_features).t().contiguous()
    return PackedIntWeight(repack_awq_qweight(qweight, out_features), scales.t().contiguous(), zero, None, 4,
                           group_size if group_size > 0 else in_features)


def gptq_to_canonical(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                      bits: int, group_size: int, v1_zeros: bool = True) -> PackedIntWeight:
    """GPTQ: qweight int32 [K * bits / 32, N] packed along K (row k of the group at bits (k % p) * bits of word k // p),
    qzeros int32 [K / group, N * bits / 32] packed along N the same way, scales [K / group, N], g_idx int32 [K] (the
    group of each input channel). v1 checkpoints (checkpoint_format "gptq") store zero - 1: z = stored + 1 (a stored
    15 gives 16, as AutoGPTQ's kernels read it); v2 stores z.

    Act-order (desc_act): g_idx is not k // group. The canonical layout needs each group's channels contiguous, so
    K is sorted by group (stably): W's columns become W[:, perm] and input_perm = perm, the GEMM reading
    x[:, perm] (a gather of x's columns inside the kernel, no extra pass). y = x[:, perm] @ W[:, perm].T = x @ W.T.
    Under tensor parallelism a row-parallel layer's shard must be sorted within the shard (its own perm)."""
    _check_bits(bits)
    in_features, out_features = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if group_size <= 0:
        group_size = in_features
    zero = unpack_gptq_zeros(qzeros, bits, out_features, v1_zeros)
    perm = None if g_idx is None else act_order_perm(g_idx, group_size)
    weight = repack_gptq_qweight(qweight, bits, perm).contiguous()
    return PackedIntWeight(weight, scales.t().contiguous(), zero, perm, bits, group_size)


def repack_gptq_qweight(qweight: torch.Tensor, bits: int, perm: torch.Tensor | None) -> torch.Tensor:
    """GPTQ qweight int32 [K * bits / 32, N] -> the canonical weight_packed [N, K * bits / 32]: packed along K as it
    is (a transposed view), or, with act-order's perm, its columns in perm's order. perm may live elsewhere than
    qweight (the layer's g_idx is on the GPU, the checkpoint's tensor arrives on the CPU): the result is on qweight's
    device."""
    if perm is None:
        return qweight.t()
    values = unpack_int32(qweight.t(), bits, qweight.shape[0] * (32 // bits))
    return pack_int32(values[:, perm.to(values.device, torch.long)], bits)


def unpack_gptq_zeros(qzeros: torch.Tensor, bits: int, out_features: int, v1_zeros: bool = True) -> torch.Tensor:
    """GPTQ qzeros int32 [K / group, N * bits / 32] (packed along N) -> the canonical uint8 [N, K / group]; v1
    checkpoints store zero - 1 (see gptq_to_canonical)."""
    _check_bits(bits)
    zero = unpack_int32(qzeros, bits, out_features).t().contiguous()
    if v1_zeros:
        if bits == 8 and (zero == 255).any():
            raise ValueError("a GPTQ v1 8-bit zero point stored as 255 reads as 256, which the uint8 zero points of "
                             "the canonical layout cannot hold")
        zero = zero + 1
    return zero


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """GPTQ act-order: the input channels sorted by group (stably), int32 [K], or None when g_idx is in order
    already (k // group_size). Each group must hold group_size channels."""
    g_idx = g_idx.to(torch.int64)
    in_order = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise ValueError(f"g_idx does not give every group {group_size} channels: not a GPTQ act-order permutation")
    return perm.to(torch.int32)
