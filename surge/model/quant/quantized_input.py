"""Activation quantization fused into the layer before the GEMM: a norm or SiLU-and-mul whose output only one linear
layer reads quantizes it for that layer in its own kernel, saving the GEMM's separate quantization launch.

The seam, set once after the methods are assigned (quantize_model -> each module's `fuse_input_quant`): a consumer's
LinearMethod says which quantization of its input a producer may do (`input_quant`); the producer holds that
InputQuant as `output_quant` and, when `wanted(x)` says so for this call, returns a QuantizedInput instead of a
tensor, which the consumer's method takes as its activations. The policy of when (the decode GEMV's rows read
unquantized activations; a LoRA adapter reads the unquantized input) stays with the consumer's method.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from surge.kernels import quant_reference

if TYPE_CHECKING:
    from surge.model.layers.linear import Linear


class QuantizedInput(NamedTuple):
    """A linear layer's activations, quantized by the layer before it: q float8_e4m3fn [T, K], scale float32 [T, 1]
    per token or [T, K / group] (M-major, as torch._scaled_mm's 1 x group scale_a), and the dtype of the unquantized
    activations (the GEMM's output dtype)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class InputQuant:
    """fp8 quantization of `consumer`'s input, per token (group_size None) or per 1 x group_size, as its method
    would do it itself, bit for bit."""
    consumer: Linear
    group_size: int | None = None

    def wanted(self, x: torch.Tensor) -> bool:
        """Whether the consumer takes the producer's output (of which x, the producer's input, has the rows, device
        and dtype) quantized in this call."""
        return self.consumer.quant_method.takes_quantized_input(self.consumer, x)

    def quantize(self, y: torch.Tensor) -> QuantizedInput:
        """y [..., K] quantized apart: for producers without a fused kernel (the CPU's torch reference, which the
        consumer's unfused path computes too; a CUDA activation other than SiLU)."""
        y2 = y.reshape(-1, y.shape[-1])
        if y.is_cuda:
            from surge.kernels import fp8_quant as kernels
            q, scale = kernels.scaled_fp8_quant_per_token(y2) if self.group_size is None else \
                kernels.per_token_group_quant_fp8(y2, self.group_size)
        else:
            q, scale = quant_reference.fp8_quant_per_token(y2) if self.group_size is None else \
                quant_reference.fp8_quant_per_token_group(y2, self.group_size)
        return QuantizedInput(q, scale, y.dtype)


def input_quant_of(linear: Linear | None) -> InputQuant | None:
    """The quantization a producer may do for `linear` (the one layer reading its output), if its method has one."""
    return None if linear is None else linear.quant_method.input_quant(linear)
