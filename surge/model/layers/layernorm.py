"""LayerNorm (mean and variance over the last dimension) with an optional weight and bias, computed in float32 as
HF's OLMo and Cohere norms are; like RMSNorm it may take the residual that precedes it and return the sum too."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, *, weight: bool = True, bias: bool = False) -> None:
        """weight/bias False: no learned scale/shift (OLMo's norms have neither, Cohere's have no bias)."""
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False) if weight else None
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), (self.hidden_size,), weight, bias, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
