"""AutoAWQ checkpoints (`quant_method: "awq"`, the GEMM layout): 4-bit weights with group scales and zero points,
activations unquantized; each tensor converted as it loads into the W4A16 layout (surge/model/quant/wna16.py), so
the int GEMM serves them on CUDA and the CPU dequantizes.

Per linear W [N out, K in]: qweight int32 [K, N / 8] and qzeros int32 [K / group, N / 8], both packed along N in
AutoAWQ's order (int_packing.AWQ_PACK_ORDER); scales [K / group, N]. W[n, k] = (w - z) * s, w and z unsigned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.int_packing import repack_awq_qweight, unpack_awq
from surge.model.quant import QuantConfig, _group_size, _refuse, register_quant_method
from surge.model.quant.wna16 import RepackedWNA16Method


@dataclass(frozen=True)
class AWQLinearMethod(RepackedWNA16Method):
    name: str = "awq"

    def convert(self, name: str, loaded: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        if name == "scales":
            return loaded.t()
        columns = loaded.shape[1] * 8
        if name == "qzeros":
            return unpack_awq(loaded, columns).t()
        return repack_awq_qweight(loaded, columns)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, cfg: dict) -> None:
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise _refuse("bits", bits, "4")
        group = _group_size(cfg.get("group_size", cfg.get("q_group_size")))
        if cfg.get("zero_point", True) is not True:
            raise _refuse("zero_point", cfg.get("zero_point"), "true")
        version = cfg.get("version", "gemm")
        if str(version).lower() != "gemm":
            raise _refuse("version", version, "'gemm' (AutoAWQ's GEMM layout; GEMV and ExLlama layouts differ)")
        self.ignore = tuple(cfg.get("modules_to_not_convert") or ())
        self.method = AWQLinearMethod(bits=4, group_size=group, symmetric=False)


register_quant_method("awq", AWQConfig)
