"""Weight-only int4 / int8 with group (or per-channel) scales and optional zero points, activations unquantized
(W4A16, W8A16). One storage, compressed-tensors' pack-quantized layout, which AWQ and GPTQ checkpoints are converted
into as they load:
- `weight_packed` int32 [N, K * bits / 32]: values along K, element i at bits (i * bits) % 32 of word i * bits // 32,
  each stored as q + 2^(bits - 1) (unsigned);
- `weight_scale` [N, K / group] in the activations' dtype ([N, 1] per channel);
- `weight_zero_point` int32 [N * bits / 32, K / group], packed along N the same way (asymmetric schemes only).
w = (q - zero) * scale. CUDA: up to 4 rows surge/kernels/gemv.py's int GEMV, more the int4/int8 GEMM
(surge/kernels/int4_gemm.py), both dequantizing in registers;
elsewhere the weight is dequantized once into a cached copy and the ordinary GEMM runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.quant_reference import dequantize_packed, pack_int32
from surge.model.quant.base import LinearMethod, Sharding, add_param
from surge.model.quant.fp8 import GEMV_ROWS


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
        return dequantize_packed(layer.weight_packed, layer.weight_scale.float(), self.bits,
                                 self.group_size or layer.in_features, self._zero_point(layer),
                                 layer.in_features).to(layer.params_dtype)

    def _zero_point(self, layer) -> torch.Tensor | None:
        """The kernel's unsigned zero points [N, K / group] (uint8), unpacked once from the checkpoint's words."""
        if self.symmetric:
            return None
        key = (layer.weight_zero_point.data_ptr(), layer.weight_zero_point._version)
        cached = layer.__dict__.get("_wna16_zero")
        if cached is None or cached[0] != key:
            from surge.kernels.int_packing import unpack_ct_zero_point
            cached = layer.__dict__["_wna16_zero"] = (key, unpack_ct_zero_point(layer.weight_zero_point, self.bits,
                                                                                 layer.out_features))
        return cached[1]

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        dense = torch.empty(layer.out_features, layer.in_features, device=layer.weight_packed.device)
        dense.normal_(0.0, 0.02, generator=gen)
        self.load_dense(layer, dense)

    def load_dense(self, layer, dense: torch.Tensor) -> None:
        q, scale, zero = quantize_rtn(dense, self.bits, self.group_size, self.symmetric)
        offset = 1 << (self.bits - 1)  # stored unsigned
        layer.weight_packed.data.copy_(pack_int32(q + offset, self.bits))
        layer.weight_scale.data.copy_(scale)
        if zero is not None:
            layer.weight_zero_point.data.copy_(pack_int32((zero + offset).t(), self.bits).t())

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            group = self.group_size or layer.in_features
            x2 = x.reshape(-1, x.shape[-1])
            if x2.shape[0] <= GEMV_ROWS:  # decode: stream the packed weight, no tensor-core tile padding
                from surge.kernels.gemv import int_gemv
                out = int_gemv(x2, layer.weight_packed, layer.weight_scale, bits=self.bits, group_size=group,
                               zero_point=self._zero_point(layer), bias=bias)
                return out.view(*x.shape[:-1], out.shape[-1])
            from surge.kernels.int4_gemm import int_gemm
            return int_gemm(x, layer.weight_packed, layer.weight_scale, bits=self.bits, group_size=group,
                            zero_point=self._zero_point(layer), bias=bias)
        from surge.model.layers.gemm import linear
        key = (layer.weight_packed.data_ptr(), layer.weight_packed._version, layer.weight_scale._version)
        cached = layer.__dict__.get("_wna16_dense")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False):  # a tensor with a version counter, for the GEMM's packed copy
                cached = layer.__dict__["_wna16_dense"] = (key, self.dense_weight(layer))
        return linear(x, cached[1], bias, owner=layer)
