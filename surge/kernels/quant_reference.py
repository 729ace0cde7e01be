"""Plain-torch definitions of the quantization kernels (fp8 activation quantization, packed-int and MXFP4 weight
dequantization): the CPU path of the quantized methods and the reference the Triton kernels are tested against.

Every function states its rounding, so the kernels can match it bit for bit where they claim to. No Triton here.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A row of zeros would give scale 0 and 0 * inf; vLLM floors dynamic scales at the same value.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def saturate_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (float32) saturated to +-448, rounded to nearest even e4m3 (torch's cast does not saturate: 449 would become
    NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_fp8(x: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """x (float32) times the inverse scale, saturated and rounded (saturate_fp8)."""
    return saturate_fp8(x * inverse_scale)


def _div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded once (IEEE), as the kernels' div_rn: on CUDA, torch divides by a Python scalar as a
    multiplication by its reciprocal, which is one ulp off for some x (and then q one fp8 step off)."""
    return torch.div(x, torch.full_like(x, divisor))


def _dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """max(amax / 448, 1/(448*512)), the division rounded once."""
    return _div(amax, FP8_MAX).clamp_min(FP8_MIN_SCALE)


def fp8_quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, 1]) with scale = max(amax(|x row|) / 448, 1/(448*512))
    and q = sat(x * (1 / scale)), all in float32 (IEEE division). x ~= q * scale."""
    xf = x.float()
    scale = _dynamic_scale(xf.abs().amax(dim=-1, keepdim=True))
    return _to_fp8(xf, 1.0 / scale), scale


def fp8_quant_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q float8_e4m3fn, scale float32 [1]). A static scale (a one-element tensor) is used as given;
    without one, the dynamic scale is max(amax(|x|) / 448, 1/(448*512)) over the whole tensor."""
    xf = x.float()
    if scale is None:
        scale = _dynamic_scale(xf.abs().amax())
    scale = scale.float().reshape(1)
    return _to_fp8(xf, 1.0 / scale), scale


def fp8_quant_per_token_group(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group_size)]): per_token rules applied to each
    group of group_size consecutive columns (a last partial group scales its own columns). The scale is M-major
    (stride (1, M)), the layout torch._scaled_mm's 1x128 blockwise scale_a takes."""
    m, k = x.shape
    groups = -(-k // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scale = _dynamic_scale(xf.abs().amax(dim=-1, keepdim=True))
    q = _to_fp8(xf, 1.0 / scale).view(m, groups * group_size)[:, :k]
    return q.contiguous(), scale.view(m, groups).t().contiguous().t()


def fp8_fake_quant(x: torch.Tensor, scheme: str, static_scale: torch.Tensor | None = None,
                   group_size: int = 128) -> torch.Tensor:
    """x [M, K] quantized to fp8 and back (float32), as a quantized GEMM sees its activations. scheme: "token"
    (dynamic per token; a static_scale makes it per tensor) or "group" (1 x group_size)."""
    if scheme == "group":
        q, scale = fp8_quant_per_token_group(x, group_size)
        return dequantize_fp8(q, scale, block=(1, group_size))
    q, scale = fp8_quant_per_token(x) if static_scale is None else fp8_quant_per_tensor(x, static_scale)
    return dequantize_fp8(q, scale)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q fp8 [..., R, C] times its scale, rounded once to dtype. scale broadcasts against q ([1], [R, 1], [1, C],
    [..., R, 1]) or, with block = (br, bc), holds one value per br x bc block: [..., ceil(R / br), ceil(C / bc)]
    (DeepSeek's weight_scale_inv; [M, K/128] activation scales with block (1, 128))."""
    qf = q.float()
    if block is not None:
        scale = expand_blocks(scale.float(), block, *qf.shape[-2:])
    return (qf * scale.float()).to(dtype)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """One value per br x bc block, [..., ceil(rows / br), ceil(cols / bc)] -> one per element, [..., rows, cols]."""
    return scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]


# ---- Packed integer weights (compressed-tensors pack-quantized; AWQ and GPTQ convert into it) ----


def unpack_int32(packed: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """packed int32 [..., ceil(size * bits / 32)] -> uint8 [..., size]: element i at bits [i * bits, (i + 1) * bits)
    of the little-endian bit stream, i.e. word i // (32 / bits), shift (i % (32 / bits)) * bits (bits 4 or 8: no
    value straddles a word). The unsigned stored value, as compressed-tensors' pack_to_int32 writes q + 2^(bits-1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :size].to(torch.uint8)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """unpack_int32's inverse: uint8/int values in [0, 2^bits) [..., size] -> int32 [..., ceil(size * bits / 32)]
    (the last word zero-padded)."""
    per_word = 32 // bits
    size = values.shape[-1]
    padded = torch.nn.functional.pad(values.to(torch.int64), (0, -size % per_word))
    words = padded.unflatten(-1, (-1, per_word))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    packed = (words << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def dequantize_packed(weight_packed: torch.Tensor, weight_scale: torch.Tensor, bits: int, group_size: int,
                      zero_point: torch.Tensor | None = None, in_features: int | None = None) -> torch.Tensor:
    """The canonical packed-int weight -> W [N, K] in weight_scale's dtype:
    W[n, k] = (u[n, k] - z[n, k // group_size]) * weight_scale[n, k // group_size], u the unsigned values of
    weight_packed int32 [N, K * bits / 32] (unpack_int32 along K), z the unsigned zero point uint8 [N, K / group]
    (2^(bits-1) when None: symmetric). (u - z) is exact in every float dtype; the product is rounded once, as
    compressed-tensors' dequantization rounds it. in_features defaults to the packed width times 32 / bits."""
    k = in_features if in_features is not None else weight_packed.shape[-1] * (32 // bits)
    u = unpack_int32(weight_packed, bits, k).to(torch.int32)
    if zero_point is None:
        centered = u - (1 << (bits - 1))
    else:
        centered = u - zero_point.to(torch.int32).repeat_interleave(group_size, dim=-1)[..., :k]
    return centered.to(weight_scale.dtype) * weight_scale.repeat_interleave(group_size, dim=-1)[..., :k]


def int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, bits: int, group_size: int,
             zero_point: torch.Tensor | None = None, input_perm: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x[:, input_perm] @ dequantize_packed(...).T + bias in x's dtype (F.linear on the dequantized weight);
    input_perm (GPTQ act-order, see int_packing.gptq_to_canonical) reorders x's columns into the weight's order."""
    weight = dequantize_packed(weight_packed, weight_scale.to(x.dtype), bits, group_size, zero_point, x.shape[-1])
    if input_perm is not None:
        x = x.index_select(-1, input_perm.long())
    return torch.nn.functional.linear(x, weight, bias)


# ---- MXFP4 (gpt-oss experts) ----

# e2m1 codes 0..15: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., N, K / 32, 16] (two e2m1 codes per byte, the low nibble first), scales uint8
    [..., N, K / 32] (e8m0: 2^(s - 127)) -> W [..., N, K] in dtype: each code's value times its block's scale (a
    power of two, so exact while the product is a normal number)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()  # [..., N, K / 32, 32]
    values = table[codes] * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(dtype)
