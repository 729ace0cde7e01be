"""RMSNorm, optionally fused with the residual add that precedes it (the layout every decoder layer uses).
On CUDA a Triton kernel (surge/kernels/norm.py) does it in one pass; torch elsewhere."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge.kernels.reference import rms_norm as rms_norm_reference
from surge.model.quant.quantized_input import InputQuant, QuantizedInput


class RMSNorm(nn.Module):
    """`output_quant`: set where one fp8 linear layer alone reads the output (surge/model/quant/quantized_input.py);
    then, when that layer wants it, the output is returned quantized (on CUDA by the norm's own kernel)."""
    output_quant: InputQuant | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's own: the reference's operations in the same order (bitwise equal), in fewer dispatches.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.output_quant is not None and self.output_quant.wanted(x):
            return self._forward_quantized(x, residual)
        if x.is_cuda:  # one fused Triton pass instead of ~7 elementwise kernels
            from surge.kernels.norm import fused_add_rms_norm, rms_norm
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _forward_quantized(self, x: torch.Tensor, residual: torch.Tensor | None
                           ) -> QuantizedInput | tuple[QuantizedInput, torch.Tensor]:
        """forward, its normalized output quantized for the next layer: in the same Triton pass on CUDA."""
        quant = self.output_quant
        if x.is_cuda:
            from surge.kernels.norm import fused_add_rms_norm_fp8, rms_norm_fp8
            dtype = torch.promote_types(self.weight.dtype, x.dtype)
            if residual is None:
                return QuantizedInput(*rms_norm_fp8(x, self.weight, self.eps, quant.group_size), dtype)
            q, scale, residual = fused_add_rms_norm_fp8(x, residual, self.weight, self.eps, quant.group_size)
            return QuantizedInput(q, scale, dtype), residual
        if residual is None:
            return quant.quantize(self._norm(x))
        x = x + residual
        return quant.quantize(self._norm(x)), x


class TorchNorm(nn.Module):
    """A norm computed by its `_norm` in torch on every device, optionally after the residual add before it."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(TorchNorm, RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), the whole product in float32 and only then cast to x's dtype
    (HF's GemmaRMSNorm; checkpoints hold the offset-free weight, zeros being the identity). Torch on every device:
    the Triton kernel rounds the normalised value to x's dtype before the weight product and has no offset."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(TorchNorm):
    """LayerNorm over the last dimension (GPT-NeoX, Phi-2, StableLM, StarCoder2, OLMo, Cohere): with or without a
    bias, or non-parametric (affine=False), computed in float32 and cast back, as HF's OLMo and Cohere norms are (and
    as torch's own does inside for half precision). Like RMSNorm, optionally fused with the preceding residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, affine: bool = True) -> None:
        super().__init__()
        self.eps, self.shape = eps, (hidden_size,)
        weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False) if affine else None
        self.register_parameter("weight", weight)
        self.register_parameter("bias", nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
                                if affine and bias else None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.shape, weight, bias, self.eps).to(x.dtype)
