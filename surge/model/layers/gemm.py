"""The dense GEMM under every linear layer and the LM head: oneDNN's matmul on the CPU, `F.linear` elsewhere.

On CPU, torch's `F.linear` goes to MKL's sgemm, which is slow for the few-row inputs of decoding. oneDNN is faster
on the same plain weights, and faster again on a copy in its own blocked layout, packed once per weight on first use
(the default model, one thread: 30 layers at 16 rows 66 -> 43 ms, 4 rows 43 -> 23 ms, 1024 rows 2.07 -> 1.96 s).
The copy costs the weight's size again in host memory; SURGE_CPU_PACKED_WEIGHTS=0 keeps plain weights only.
Parameters stay as they are (loaders, the weight cache and TP see the same tensors); a weight rebound or rewritten
since it was packed (`drop_packed_weights` after loading in place) is packed again. Results differ from MKL's only in
summation order (float32: ~1e-6).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge import envs

# Dtypes oneDNN's matmul serves on the CPU (bfloat16 natively where the CPU has AVX512-BF16 or AMX).
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# The batch size the blocked layout is chosen for: at least as fast as the plain weight from 1 row to prefill sizes.
_PACK_ROWS = 16


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           owner: nn.Module | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., in], weight [out, in]; as `F.linear`. With `owner` (the layer holding the
    weight), oneDNN reads the owner's packed copy of it."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if owner is not None:
        weight = _packed(owner, weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed(owner: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The owner's packed copy of `weight`, packed now if it has none or the weight changed since; `weight` itself
    when SURGE_CPU_PACKED_WEIGHTS is off (read when a copy would be made, not on every call: 121 GEMMs a step)."""
    key = (weight.data_ptr(), weight._version, weight.shape)
    cached = owner.__dict__.get("_onednn_weight")  # a plain attribute: no parameter, buffer or state_dict entry
    if cached is not None and cached[0] == key:
        return cached[1]
    if not envs.SURGE_CPU_PACKED_WEIGHTS:
        return weight
    cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS))
    owner.__dict__["_onednn_weight"] = cached
    return cached[1]


def drop_packed_weights(model: nn.Module) -> None:
    """Forget every packed copy (call after writing weights in place: `param.data.copy_` leaves no trace to see)."""
    for module in model.modules():
        module.__dict__.pop("_onednn_weight", None)
