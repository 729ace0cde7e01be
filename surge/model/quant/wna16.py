"""Weight-only int4 / int8 with group (or per-channel) scales and optional zero points, activations unquantized
(W4A16, W8A16). One storage, compressed-tensors' pack-quantized layout, which AWQ and GPTQ checkpoints are converted
into as they load:
- `weight_packed` int32 [N, K * bits / 32]: values along K, element i at bits (i * bits) % 32 of word i * bits // 32,
  each stored as q + 2^(bits - 1) (unsigned);
- `weight_scale` [N, K / group] in the activations' dtype ([N, 1] per channel);
- `weight_zero_point` int32 [N * bits / 32, K / group], packed along N the same way (asymmetric schemes only).
w = (q - zero) * scale. CUDA: the int4/int8 GEMM kernel (surge/kernels/wna16_gemm.py) where present; elsewhere the
weight is dequantized once into a cached copy and the ordinary GEMM runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.model.quant.base import LinearMethod, Sharding, add_param


def unpack_int32(packed: torch.Tensor, bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> the `size` signed values packed along `dim` (int32)."""
    per_word = 32 // bits
    x = packed if dim == 1 else packed.t()
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    values = values.reshape(x.shape[0], -1)[:, :size] - (1 << (bits - 1))
    assert per_word * x.shape[1] >= size
    return values if dim == 1 else values.t()


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed values (int) -> int32 words along `dim`: `unpack_int32`'s inverse (the tests' and presets' packer)."""
    per_word = 32 // bits
    x = values if dim == 1 else values.t()
    rows, cols = x.shape
    pad = -cols % per_word
    u = torch.nn.functional.pad((x.to(torch.int64) + (1 << (bits - 1))), (0, pad)).view(rows, -1, per_word)
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (u << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.contiguous() if dim == 1 else words.t().contiguous()


def quantize_rtn(w: torch.Tensor, bits: int, group: int | None, symmetric: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest: a dense [N, K] weight -> (q int32 [N, K], scales float32 [N, K/group], zero points int32 or
    None), as llm-compressor's data-free path; w ~ (q - zero) * scale."""
    n, k = w.shape
    g = k if group is None else group
    blocks = w.float().view(n, k // g, g)
    qmax, qmin = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    if symmetric:
        scale = (blocks.abs().amax(-1) / ((qmax - qmin) / 2)).clamp_(min=1e-8)
        q = (blocks / scale.unsqueeze(-1)).round_().clamp_(qmin, qmax)
        return q.view(n, k).int(), scale, None
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (qmax - qmin)).clamp_(min=1e-8)
    zero = (qmin - lo / scale).round_().clamp_(qmin, qmax)
    q = (blocks / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round_().clamp_(qmin, qmax)
    return q.view(n, k).int(), scale, zero.int()


@dataclass(frozen=True)
class WNA16LinearMethod(LinearMethod):
    bits: int = 4
    group_size: int | None = 128  # None: one scale per output channel
    symmetric: bool = True
    name: str = "wna16"

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"int{self.bits} weights, {group}, {'symmetric' if self.symmetric else 'zero points'}"

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        per_word = 32 // self.bits
        g = self.group_size
        if g is not None and k % g:
            raise ValueError(f"int{self.bits} group_size={g} does not divide this rank's input size {k}")
        if k % per_word:
            raise ValueError(f"int{self.bits} packing needs the input size ({k}) to be a multiple of {per_word}")
        groups = 1 if g is None else k // g
        add_param(layer, "weight_packed", (n, k // per_word), torch.int32, Sharding(1, per_word), device=device)
        add_param(layer, "weight_scale", (n, groups), layer.params_dtype, Sharding(1, g), device=device)
        if not self.symmetric:
            add_param(layer, "weight_zero_point", (-(-n // per_word), groups), torch.int32, Sharding(per_word, g),
                      device=device)

    def dense_weight(self, layer) -> torch.Tensor:
        n, k = layer.out_features, layer.in_features
        q = unpack_int32(layer.weight_packed, self.bits, k).float()
        scale = layer.weight_scale.float()
        groups = scale.shape[1]
        if not self.symmetric:
            zero = unpack_int32(layer.weight_zero_point, self.bits, n, dim=0).float()
            q = q.view(n, groups, -1) - zero.unsqueeze(-1)
        return (q.view(n, groups, -1) * scale.unsqueeze(-1)).view(n, k).to(layer.params_dtype)

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        dense = torch.empty(layer.out_features, layer.in_features, device=layer.weight_packed.device)
        dense.normal_(0.0, 0.02, generator=gen)
        self.load_dense(layer, dense)

    def load_dense(self, layer, dense: torch.Tensor) -> None:
        q, scale, zero = quantize_rtn(dense, self.bits, self.group_size, self.symmetric)
        layer.weight_packed.data.copy_(pack_int32(q, self.bits))
        layer.weight_scale.data.copy_(scale)
        if zero is not None:
            layer.weight_zero_point.data.copy_(pack_int32(zero, self.bits, dim=0))

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from surge.model.layers.gemm import linear
        key = (layer.weight_packed.data_ptr(), layer.weight_packed._version, layer.weight_scale._version)
        cached = layer.__dict__.get("_wna16_dense")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False):  # a tensor with a version counter, for the GEMM's packed copy
                cached = layer.__dict__["_wna16_dense"] = (key, self.dense_weight(layer))
        return linear(x, cached[1], bias, owner=layer)
