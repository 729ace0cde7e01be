"""FP8 (e4m3) weights: per-tensor, per-channel or in blocks (DeepSeek / Qwen3-FP8: 128x128), activations quantized
per token or per 1x128 group as they come (dynamic) or with a checkpoint scale (static). Serves HF's `fp8`
quant_method, compressed-tensors' float-quantized schemes, and online quantization of a bf16 checkpoint
(`--quantization fp8`: per-channel weights quantized as they load, per-token dynamic activations).

Storage: `weight` float8_e4m3fn [N, K]; the weight scale as float32 [N, 1] for per-tensor and per-channel schemes (a
per-tensor scale fills its shard's rows, so q, k and v keep their own) or [ceil(N/bn), ceil(K/bk)] for blocks; a
static activation scale float32 [1] (the largest of a merged layer's shards). Names as the checkpoint's: HF writes
`weight_scale_inv` / `activation_scale`, compressed-tensors `weight_scale` / `input_scale`.

CUDA with bf16/fp16 activations: up to 4 rows (decode at small batch), surge.kernels.gemv.py streams the fp8
weight against the activations as they are (weight-only W8A16: the batch-1 step reads each weight byte once, with no
quantization launch; its stream kernel by default, SURGE_FP8_GEMV=tiles the earlier
one); up to 32 rows the same weight-only math on tensor cores (surge.kernels.fp8_wo_gemm.py: decode
batches are still the weight's bandwidth, where cuBLASLt's fp8 tiles are not); more rows, torch._scaled_mm, row-wise
(scale_a [M, 1], scale_b [1, N]) or block-wise (1x128 x 128x128), activations quantized by
surge/kernels/fp8_quant.py, or, where an RMSNorm or SiLU-and-mul feeds this layer alone (qkv, gate_up, down), by that
layer's own kernel (`input_quant`, quantized_input.py): the GEMM then gets a QuantizedInput and launches nothing
else. Elsewhere (CPU, float32, other block shapes) the weight is dequantized once (a cached copy in the activations'
dtype) and the activations' quantization simulated in float32 (quantize, dequantize; kernels/quant_reference.py),
then the ordinary GEMM: the same math, the reference the GPU path is tested against. A QuantizedInput is dequantized
there likewise.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from surge.kernels.quant_reference import FP8_DTYPE as FP8
from surge.kernels.quant_reference import FP8_MAX
from surge.kernels.quant_reference import FP8_MIN_SCALE as MIN_SCALE
from surge.kernels.quant_reference import dequantize_fp8, expand_blocks, fp8_fake_quant, saturate_fp8
from surge.model.quant.base import LinearMethod, Sharding, add_param
from surge.model.quant.quantized_input import InputQuant, QuantizedInput

GEMV_ROWS = 4  # surge.kernels.gemv.py's MAX_ROWS (not imported here: it imports Triton)
WO_GEMM_ROWS = 32  # up to here fp8_wo_gemm beats torch._scaled_mm on Qwen3-8B's layers (H200, bench kernels --only wo)
# The weight-only kernels (W8A16: bf16 activations as they are) by the most rows each serves, smallest first: (rows,
# module in surge.kernels, function). Above the last, the activations are quantized for torch._scaled_mm.
WEIGHT_ONLY_KERNELS = ((GEMV_ROWS, "gemv", "fp8_gemv"), (WO_GEMM_ROWS, "fp8_wo_gemm", "fp8_wo_gemm"))


def quantize_weight(w: torch.Tensor, scheme: str, block: tuple[int, int] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight (per channel: [..., N, K], e.g. experts) -> (fp8 of its shape, float32 scales as
    `Fp8LinearMethod` / `Fp8MoEMethod` store them). Random weights for presets, online quantization, and the tests'
    checkpoints."""
    w = w.float()
    if scheme == "block":
        n, k = w.shape
        bn, bk = block
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, device=w.device)
        pad[:n, :k] = w
        amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3))
    elif scheme == "tensor":
        amax = w.abs().amax().expand(w.shape[0], 1)
    else:
        amax = w.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    return saturate_fp8(w / (expand_blocks(scale, block, n, k) if scheme == "block" else scale)), scale


# ---- the linear method ----

@dataclass(frozen=True)
class Fp8LinearMethod(LinearMethod):
    """weights: "tensor", "channel" or "block" (with `block` (bn, bk)); activations: "token" (dynamic per token),
    "group" (dynamic per 1 x bk group, with block weights) or "static"; online: the checkpoint holds unquantized
    weights, quantized per channel as they load."""
    weights: str = "channel"
    activations: str = "token"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    input_scale_name: str = "input_scale"
    online: bool = False
    name: str = "fp8"

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"fp8 {self.weights}{block} weights, {self.activations} activations" + (" (online)" if self.online
                                                                                         else "")

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        add_param(layer, "weight", (n, k), FP8, device=device)
        if self.weights == "block":
            bn, bk = self.block
            add_param(layer, self.scale_name, (-(-n // bn), -(-k // bk)), torch.float32, Sharding(bn, bk),
                      device=device)
        else:  # per row, one column: not split along the input
            add_param(layer, self.scale_name, (n, 1), torch.float32,
                      Sharding(1, None, scalar=self.weights == "tensor"), device=device)
        if self.activations == "static":
            add_param(layer, self.input_scale_name, (1,), torch.float32, Sharding(None, None, reduce_max=True),
                      device=device, fill=0.0)
        if self.online:
            layer.weight.on_load = self._quantize_on_load(layer)
            getattr(layer, self.scale_name).loaded_with = "weight"  # written by the weight's on_load

    def _quantize_on_load(self, layer):
        def on_load(param: nn.Parameter, dim: int, start: int, source: torch.Tensor) -> None:
            """Rows [start, ...) of the weight (dim 0: a merged layer's shard) or all rows of this rank's input
            slice (dim 1), from their unquantized values: each row scaled on its own."""
            source = source.to(param.device)
            q, scale = quantize_weight(source, "channel", None)
            rows = slice(start, start + source.shape[0]) if dim == 0 else slice(None)
            param.data[rows] = q
            getattr(layer, self.scale_name).data[rows] = scale
        return on_load

    def moe_method(self):
        """Experts quantized alike: block weights with group activations, or per-channel with per-token ones."""
        from surge.model.quant.fp8_moe import Fp8MoEMethod
        if self.weights == "block" and self.activations == "group":
            return Fp8MoEMethod("block", self.block, self.scale_name)
        if self.weights == "channel" and self.activations == "token":
            return Fp8MoEMethod("channel", None, self.scale_name, self.online)
        return super().moe_method()

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        dense = torch.empty(layer.out_features, layer.in_features, device=layer.weight.device)
        dense.normal_(0.0, 0.02, generator=gen)
        q, scale = quantize_weight(dense, self.weights, self.block)
        layer.weight.data.copy_(q)
        getattr(layer, self.scale_name).data.copy_(scale)
        if self.activations == "static":
            getattr(layer, self.input_scale_name).data.fill_(0.05)

    def dense_weight(self, layer) -> torch.Tensor:
        return dequantize_fp8(layer.weight, getattr(layer, self.scale_name), self.block, layer.params_dtype)

    def input_quant(self, layer) -> InputQuant | None:
        """Dynamic activations (per token; per 1 x bk group with block weights): the layer before may quantize them
        in its own kernel. Static ones (a checkpoint scale) stay here."""
        if self.activations == "token":
            return InputQuant(layer)
        if self.activations == "group":
            return InputQuant(layer, self.block[1])
        return None

    def takes_quantized_input(self, layer, x: torch.Tensor) -> bool:
        """Every call that quantizes its activations, unless a LoRA adapter reads them unquantized: on the
        torch._scaled_mm path above WO_GEMM_ROWS rows (the GEMV and the weight-only GEMM read them as they are), for
        group scales only at row counts cuBLASLt takes unpadded (multiples of 4: every decode graph above 4 rows, every
        mixed graph); on the dequantized path always."""
        if layer.lora is not None:
            return False
        if not self._scaled_mm_serves(x.is_cuda, x.dtype):
            return True
        rows = x.numel() // x.shape[-1]
        return rows > WEIGHT_ONLY_KERNELS[-1][0] and not (self.activations == "group" and rows % 4)

    def apply(self, layer, x: torch.Tensor | QuantizedInput, bias: torch.Tensor | None) -> torch.Tensor:
        if type(x) is QuantizedInput:
            return self._apply_quantized(layer, x, bias)
        if self.scaled_mm_serves(x):
            return self._apply_cuda(layer, x, bias)
        from surge.model.layers.gemm import linear
        x2 = x.reshape(-1, x.shape[-1])
        x_sim = fp8_fake_quant(x2, "group" if self.activations == "group" else "token",
                               getattr(layer, self.input_scale_name, None), self.block[1] if self.block else 128)
        return linear(x_sim.to(x.dtype).view(x.shape), self.cached_dense_weight(layer), bias, owner=layer)

    def scaled_mm_serves(self, x: torch.Tensor) -> bool:
        """torch._scaled_mm on the H200: bf16 (or fp16) activations, row-wise scales or 128 x 128 blocks. Otherwise
        (CPU, float32 models, other blocks) the dequantized path, which computes the same math."""
        return self._scaled_mm_serves(x.is_cuda, x.dtype)

    def _scaled_mm_serves(self, is_cuda: bool, dtype: torch.dtype) -> bool:
        return is_cuda and dtype in (torch.bfloat16, torch.float16) and self.block in (None, (128, 128))

    def _apply_quantized(self, layer, x: QuantizedInput, bias: torch.Tensor | None) -> torch.Tensor:
        """Activations the layer before quantized as this method would (input_quant): the GEMM alone, or on the
        dequantized path the activations dequantized (as fp8_fake_quant does after quantizing)."""
        q = x.q.reshape(-1, x.q.shape[-1])
        if self._scaled_mm_serves(q.is_cuda, x.dtype):
            out = self._scaled_mm(layer, q, x.scale, bias, x.dtype)
        else:
            from surge.model.layers.gemm import linear
            x_sim = dequantize_fp8(q, x.scale, (1, self.block[1]) if self.activations == "group" else None, x.dtype)
            out = linear(x_sim, self.cached_dense_weight(layer), bias, owner=layer)
        return out.view(*x.q.shape[:-1], out.shape[-1])

    def _apply_cuda(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight_only = _weight_only_kernel(x2.shape[0])
        if weight_only is not None:  # decode: the fp8 weight's bandwidth, activations as they are
            out = weight_only(x2, layer.weight, getattr(layer, self.scale_name), bias,
                              block_scales=self.block is not None)
        else:
            out = self._quantize_and_scaled_mm(layer, x2, bias)
        return out.view(*shape[:-1], out.shape[-1])

    def _quantize_and_scaled_mm(self, layer, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2 [M, K]: its activations quantized as this method's scheme says, then torch._scaled_mm."""
        rows = x2.shape[0]
        kernels = _kernels()
        if self.activations == "group":
            if rows % 4:  # cuBLASLt's block-scaled GEMM takes M in multiples of 4 (vLLM pads alike)
                x2 = torch.nn.functional.pad(x2, (0, 0, 0, -rows % 4))
            q, x_scale = kernels.per_token_group_quant_fp8(x2, self.block[1])
        elif self.activations == "static":
            input_scale = getattr(layer, self.input_scale_name)
            q, _ = kernels.scaled_fp8_quant_per_tensor(x2, input_scale)
            x_scale = input_scale.expand(rows, 1).contiguous()  # row-wise scales: cuBLASLt wants them dense
        else:
            q, x_scale = kernels.scaled_fp8_quant_per_token(x2)
        return self._scaled_mm(layer, q, x_scale, bias, x2.dtype)[:rows]

    def _scaled_mm(self, layer, q: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        """torch._scaled_mm of quantized activations [M, K] with this layer's weight: row-wise (x_scale [M, 1], the
        bias in cuBLASLt's epilogue) or 1 x 128 by 128 x 128 blocks (x_scale [M, K / 128] M-major; M a multiple of
        4; the bias, which the block-scaled GEMM does not take, added after)."""
        w, w_scale = layer.weight, getattr(layer, self.scale_name)
        if self.activations == "group":
            out = torch._scaled_mm(q, w.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=dtype)
            return out if bias is None else out + bias
        return torch._scaled_mm(q, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), bias=bias, out_dtype=dtype)


def _weight_only_kernel(rows: int) -> Callable[..., torch.Tensor] | None:
    """The weight-only kernel WEIGHT_ONLY_KERNELS names for this many rows (imported on first use: Triton), or None
    above them all."""
    for most_rows, module, function in WEIGHT_ONLY_KERNELS:
        if rows <= most_rows:
            return getattr(importlib.import_module(f"surge.kernels.{module}"), function)
    return None


def _kernels():
    """surge/kernels/fp8_quant.py's activation quantization (imported on first CUDA use: Triton)."""
    from surge.kernels import fp8_quant
    return fp8_quant
