"""The dense GEMM under every linear layer and the LM head: oneDNN's matmul on the CPU, `F.linear` elsewhere.

On CPU, torch's `F.linear` goes to MKL's sgemm, which is slow for the few-row inputs of decoding (16 rows: about
half the rate oneDNN reaches on the same plain weights, and 2x slower for one row). oneDNN takes the weight as it is
(no packed copy), so parameters, the weight cache and TP loaders see the same tensors. Results differ from MKL's
only in summation order (float32: ~1e-6).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Dtypes oneDNN's matmul serves on the CPU (bfloat16 natively where the CPU has AVX512-BF16 or AMX).
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN: CPU tensors of a dtype it serves, nothing for autograd to track."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., in], weight [out, in]; as `F.linear`."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
