"""Activations by their HF config name (`hidden_act`, `hidden_activation`): plain, and gated on a merged
[gate | up] projection (act(gate) * up). An unknown name is an error naming the field and the value."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from surge.model.quant.quantized_input import InputQuant, QuantizedInput


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:  # HF's FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608028654 * (1.0 + 0.044715 * x * x)))


def _gelu_quick(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _gelu_new(x: torch.Tensor) -> torch.Tensor:  # HF's NewGELUActivation (GPT-2's), written as HF writes it
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_new, "gelu_fast": _gelu_fast, "quick_gelu": _gelu_quick,
    "relu": F.relu, "relu2": _relu2,
}


def activation(name: str, field_name: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"config field {field_name}={name!r} is not supported; supported: "
                         f"{', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class Act(nn.Module):
    def __init__(self, name: str, field_name: str = "hidden_act") -> None:
        super().__init__()
        self.name, self.fn = name, activation(name, field_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class ActAndMul(nn.Module):
    """act(gate) * up on a merged [gate | up] projection's output [..., 2I] -> [..., I]. `output_quant`: as
    RMSNorm's, for the fp8 down projection (SiLU on CUDA quantizes in its own kernel)."""
    output_quant: InputQuant | None = None

    def __init__(self, name: str = "silu", field_name: str = "hidden_act") -> None:
        super().__init__()
        self.name, self.fn = name, activation(name, field_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedInput:
        if self.output_quant is not None and self.output_quant.wanted(x):
            return self._forward_quantized(x)
        if x.is_cuda and self.fn is F.silu:
            from surge.kernels.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.fn(gate).mul_(up)  # in place: one [T, I] buffer fewer (6 MB a layer at a 1024-token prefill)

    def _forward_quantized(self, x: torch.Tensor) -> QuantizedInput:
        """forward, its output quantized for the next layer: in the same Triton pass for SiLU on CUDA."""
        if x.is_cuda and self.fn is F.silu:
            from surge.kernels.activation import silu_and_mul_fp8
            q, scale = silu_and_mul_fp8(x.reshape(-1, x.shape[-1]), self.output_quant.group_size)
            return QuantizedInput(q, scale, x.dtype)
        gate, up = x.chunk(2, dim=-1)
        return self.output_quant.quantize(self.fn(gate).mul_(up))


class SiluAndMul(ActAndMul):
    def __init__(self) -> None:
        super().__init__("silu")
