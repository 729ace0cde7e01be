"""Weight-only int4 / int8 with group (or per-channel) scales and optional zero points, activations unquantized
(W4A16, W8A16). One storage, compressed-tensors' pack-quantized layout, which AWQ and GPTQ checkpoints are converted
into as they load:
- `weight_packed` int32 [N, K * bits / 32]: values along K, element i at bits (i * bits) % 32 of word i * bits // 32,
  each stored as q + 2^(bits - 1) (unsigned);
- `weight_scale` [N, K / group] in the activations' dtype ([N, 1] per channel);
- `weight_zero_point` int32 [N * bits / 32, K / group], packed along N the same way (asymmetric schemes only).
w = (q - zero) * scale. CUDA: the int GEMV (surge/kernels/int_gemv.py) for decode's few rows, the int4/int8 GEMM
(surge/kernels/int4_gemm.py) beyond, both dequantizing in registers;
elsewhere the weight is dequantized once into a cached copy and the ordinary GEMM runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from surge.kernels.quant_reference import dequantize_packed, pack_int32
from surge.model.quant.base import LinearMethod, Sharding, add_param, cached_on_layer


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
    # the parameters' names (AWQ and GPTQ keep their checkpoints' own: RepackedWNA16Method)
    packed_name: ClassVar[str] = "weight_packed"
    scale_name: ClassVar[str] = "weight_scale"

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"int{self.bits} weights, {group}, {'symmetric' if self.symmetric else 'zero points'}"

    def _groups(self, layer) -> int:
        k = layer.in_features
        per_word = 32 // self.bits
        g = self.group_size
        if g is not None and k % g:
            raise ValueError(f"int{self.bits} group_size={g} does not divide this rank's input size {k}")
        if k % per_word:
            raise ValueError(f"int{self.bits} packing needs the input size ({k}) to be a multiple of {per_word}")
        return 1 if g is None else k // g

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        per_word, g, groups = 32 // self.bits, self.group_size, self._groups(layer)
        add_param(layer, self.packed_name, (n, k // per_word), torch.int32, Sharding(1, per_word), device=device)
        add_param(layer, self.scale_name, (n, groups), layer.params_dtype, Sharding(1, g), device=device)
        self._create_zero_point(layer, groups, device)

    def _create_zero_point(self, layer, groups: int, device) -> None:
        if not self.symmetric:
            per_word = 32 // self.bits
            add_param(layer, "weight_zero_point", (-(-layer.out_features // per_word), groups), torch.int32,
                      Sharding(per_word, self.group_size), device=device)

    def dense_weight(self, layer) -> torch.Tensor:
        """In the input's order (act-order's stored columns put back: stored column j is input channel perm[j])."""
        packed, scale = getattr(layer, self.packed_name), getattr(layer, self.scale_name)
        dense = dequantize_packed(packed, scale.float(), self.bits, self.group_size or layer.in_features,
                                  self._zero_point(layer), layer.in_features).to(layer.params_dtype)
        perm = self._input_perm(layer)
        if perm is None:
            return dense
        unsorted = torch.empty_like(dense)
        unsorted[:, perm.long()] = dense
        return unsorted

    def _zero_point(self, layer) -> torch.Tensor | None:
        """The kernel's unsigned zero points [N, K / group] (uint8), unpacked once from the checkpoint's words."""
        if self.symmetric:
            return None
        from surge.kernels.int_packing import unpack_ct_zero_point
        zero = layer.weight_zero_point
        return cached_on_layer(layer, "_zero_point", lambda: unpack_ct_zero_point(zero, self.bits, layer.out_features),
                               (zero,))

    def _input_perm(self, layer) -> torch.Tensor | None:
        """GPTQ act-order: the order of x's columns the weight's are stored in (None: as they come)."""
        return None

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        dense = torch.empty(layer.out_features, layer.in_features, device=getattr(layer, self.packed_name).device)
        dense.normal_(0.0, 0.02, generator=gen)
        self.load_dense(layer, dense)

    def load_dense(self, layer, dense: torch.Tensor) -> None:
        q, scale, zero = quantize_rtn(dense, self.bits, self.group_size, self.symmetric)
        offset = 1 << (self.bits - 1)  # stored unsigned
        getattr(layer, self.packed_name).data.copy_(pack_int32(q + offset, self.bits))
        getattr(layer, self.scale_name).data.copy_(scale)
        if zero is not None:
            self._store_zero_point(layer, zero + offset)

    def _store_zero_point(self, layer, zero: torch.Tensor) -> None:
        """Unsigned zero points [N, K / group] into this method's storage."""
        layer.weight_zero_point.data.copy_(pack_int32(zero.t(), self.bits).t())

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            return self.cuda_gemm(layer, x, bias)
        from surge.model.layers.gemm import linear
        return linear(x, self.cached_dense_weight(layer), bias, owner=layer)

    def cuda_gemm(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The int kernels on the packed weight: the GEMV (int_gemv.py) up to its MAX_ROWS rows of x (decode: it
        streams the weight at several times int_gemm's rate there), int_gemm's tensor-core tiles beyond."""
        from surge.kernels.int4_gemm import int_gemm
        from surge.kernels.int_gemv import MAX_ROWS, int_gemv
        packed, scale = getattr(layer, self.packed_name), getattr(layer, self.scale_name)
        kernel = int_gemv if x.numel() <= MAX_ROWS * x.shape[-1] else int_gemm
        return kernel(x, packed, scale, bits=self.bits, group_size=self.group_size or layer.in_features,
                      zero_point=self._zero_point(layer), input_perm=self._input_perm(layer), bias=bias)


@dataclass(frozen=True)
class RepackedWNA16Method(WNA16LinearMethod):
    """AWQ and GPTQ checkpoints: their tensors keep their names (qweight, scales, qzeros, g_idx) but are stored in
    the canonical layout, each converted whole as it arrives (`convert`, the format's), then narrowed into this
    rank's rows or columns by the layer's loader like any other:
    - qweight int32 [N, K * bits / 32] packed along K (act-order: K sorted by group);
    - scales [N, K / group] in the activations' dtype;
    - qzeros uint8 [N, K / group], unsigned, unpacked (a GPTQ v1 zero may read 2^bits, which no packed field holds);
    - g_idx int32 [K] (act-order only): the checkpoint's; the input permutation is derived from it. A merged layer's
      parts share their input, so their g_idx must be the same (as GPTQ's act-order makes them): one permutation.
    A qweight that arrives before its layer's g_idx waits for it (act-order only)."""
    act_order: bool = False
    name: str = "repacked-wna16"
    packed_name: ClassVar[str] = "qweight"
    scale_name: ClassVar[str] = "scales"

    def convert(self, name: str, loaded: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        """A checkpoint tensor (qweight, scales or qzeros; one part of a merged layer, whole) -> the canonical
        layout; perm: act-order's column order for qweight."""
        raise NotImplementedError

    def create_weights(self, layer, device) -> None:
        super().create_weights(layer, device)
        if self.act_order:
            add_param(layer, "g_idx", (layer.in_features,), torch.int32, Sharding(None, None), device=device)
        for name, param in layer.named_parameters(recurse=False):
            if name != "bias":
                param.weight_loader = partial(self._load, layer, name)

    def _load(self, layer, name: str, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        waiting = layer.__dict__.setdefault("_qweight_waiting", [])
        if name == "g_idx":
            if loaded.shape != param.shape:
                raise ValueError(f"g_idx of shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
            if layer.__dict__.get("_g_idx_loaded") and not torch.equal(param.data, loaded.to(param.device,
                                                                                            param.dtype)):
                raise ValueError("the parts of a merged layer have different g_idx (act-order permutations); "
                                 "Surge runs them as one GEMM with one input order")
            param.data.copy_(loaded)
            layer.__dict__["_g_idx_loaded"] = True
            for qweight, shard in waiting:
                self._load(layer, "qweight", layer.qweight, qweight, shard)
            waiting.clear()
            return
        if name == "qweight" and self.act_order and not layer.__dict__.get("_g_idx_loaded"):
            waiting.append((loaded, shard_id))
            return
        perm = self._input_perm(layer) if name == "qweight" else None
        layer.weight_loader(param, self.convert(name, loaded, perm), shard_id)

    def _create_zero_point(self, layer, groups: int, device) -> None:
        add_param(layer, "qzeros", (layer.out_features, groups), torch.uint8, Sharding(1, self.group_size),
                  device=device)

    def _zero_point(self, layer) -> torch.Tensor:
        return layer.qzeros

    def _store_zero_point(self, layer, zero: torch.Tensor) -> None:
        layer.qzeros.data.copy_(zero)

    def load_dense(self, layer, dense: torch.Tensor) -> None:
        super().load_dense(layer, dense)
        if self.symmetric:
            layer.qzeros.data.fill_(1 << (self.bits - 1))
        if self.act_order:
            layer.g_idx.data.copy_(torch.arange(layer.in_features) // (self.group_size or layer.in_features))

    def _input_perm(self, layer) -> torch.Tensor | None:
        if not self.act_order:
            return None
        from surge.kernels.int_packing import act_order_perm
        g_idx, group = layer.g_idx, self.group_size or layer.in_features
        return cached_on_layer(layer, "_act_order_perm", lambda: act_order_perm(g_idx, group), (g_idx,))
