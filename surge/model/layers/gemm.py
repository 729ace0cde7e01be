"""The dense GEMM under every linear layer and the LM head: oneDNN's matmul on the CPU, `F.linear` elsewhere.

On CPU, torch's `F.linear` goes to MKL's sgemm, which is slow for the few-row inputs of decoding. oneDNN is faster
on the same plain weights, and faster again on a copy in its own blocked layout, packed once per weight on first use
(the default model, one thread: 30 layers at 16 rows 66 -> 43 ms, 4 rows 43 -> 23 ms, 1024 rows 2.07 -> 1.96 s).
The copy costs the weight's size again in host memory; SURGE_CPU_PACKED_WEIGHTS=0 keeps plain weights only.
Parameters stay as they are (loaders, the weight cache and TP see the same tensors); a weight rebound or rewritten
since it was packed (`drop_packed_weights` after loading in place) is packed again. Results differ from MKL's only in
summation order (float32: ~1e-6).

Half-precision weights are packed as they are only where the CPU computes bf16 itself (AVX512-BF16, AMX,
AVX-NE-CONVERT, aarch64 BF16). Elsewhere oneDNN refuses bf16 (AVX2: "bf16 path needs avx512bw...") or emulates it
slower than float32, so the packed copy is float32 and activations are up-cast (one thread, 1536x576, on AVX2: 16 rows
F.linear bf16 1175 us -> 270 us, 256 rows 18.8 -> 4.0 ms; AVX-512 without BF16: 16 rows 401 -> 172 us).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from surge import envs
from surge.logger import init_logger
from surge.model.layers.cpu_caps import CpuCaps, cpu_caps

logger = init_logger(__name__)

# The batch size the blocked layout is chosen for: at least as fast as the plain weight from 1 row to prefill sizes.
_PACK_ROWS = 16
_HALF = (torch.bfloat16, torch.float16)

# How a CPU GEMM of one dtype runs (cpu_gemm_path's answers).
ONEDNN = "onednn"  # oneDNN on the weight's own dtype, packed
ONEDNN_FP32 = "onednn_fp32"  # a float32 packed copy; activations up-cast, the output cast back
TORCH = "torch"  # F.linear as it is


def cpu_gemm_path(dtype: torch.dtype, caps: CpuCaps) -> str:
    """The CPU GEMM for weights and activations of `dtype` on a CPU with `caps` (a pure policy)."""
    if not caps.onednn:
        return TORCH
    if dtype == torch.float32:
        return ONEDNN
    if dtype == torch.bfloat16 and caps.onednn_bf16 and caps.native_bf16:
        return ONEDNN
    if dtype in _HALF:
        return ONEDNN_FP32
    return TORCH


_PATHS: dict[torch.dtype, str] = {}


def _path(dtype: torch.dtype) -> str:
    path = _PATHS.get(dtype)
    if path is None:
        caps = cpu_caps()
        path = _PATHS[dtype] = cpu_gemm_path(dtype, caps)
        if dtype != torch.float32:
            how = {ONEDNN: "oneDNN on packed weights of that dtype",
                   ONEDNN_FP32: "oneDNN on float32 packed copies of the weights, activations up-cast",
                   TORCH: "torch's F.linear"}[path]
            logger.info("CPU GEMM for %s: %s (%s)", str(dtype).removeprefix("torch."), how, caps.describe())
    return path


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN: CPU tensors of one dtype it serves (itself or up-cast), nothing
    for autograd to track."""
    return (x.device.type == "cpu" and weight.dtype == x.dtype and _path(x.dtype) != TORCH
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           owner: nn.Module | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): x [..., in], weight [out, in]; as `F.linear`. With `owner` (the layer holding the
    weight), oneDNN reads the owner's packed copy of it."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if _path(x.dtype) == ONEDNN_FP32:
        out_dtype = x.dtype
        x, bias = x.float(), (None if bias is None else bias.float())
        weight = _packed(owner, weight, torch.float32) if owner is not None else weight.float()
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "").to(out_dtype)
    if owner is not None:
        weight = _packed(owner, weight, weight.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed(owner: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The owner's packed copy of `weight` in `dtype`, packed now if it has none or the weight changed since;
    `weight` itself (in `dtype`) when SURGE_CPU_PACKED_WEIGHTS is off (read when a copy would be made, not on every
    call: 121 GEMMs a step)."""
    key = (weight.data_ptr(), weight._version, weight.shape)
    cached = owner.__dict__.get("_onednn_weight")  # a plain attribute: no parameter, buffer or state_dict entry
    if cached is not None and cached[0] == key:
        return cached[1]
    if not envs.SURGE_CPU_PACKED_WEIGHTS:
        return weight.to(dtype)
    cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), _PACK_ROWS))
    owner.__dict__["_onednn_weight"] = cached
    return cached[1]


def drop_packed_weights(model: nn.Module) -> None:
    """Forget every packed copy (call after writing weights in place: `param.data.copy_` leaves no trace to see)."""
    for module in model.modules():
        module.__dict__.pop("_onednn_weight", None)
