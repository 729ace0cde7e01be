"""GPTQ checkpoints (`quant_method: "gptq"`, AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" (v1) or "gptq_v2"):
4- or 8-bit weights with group scales and zero points, optionally in act-order (`desc_act`: input channels grouped
by `g_idx`), activations unquantized; each tensor converted as it loads into the W4A16/W8A16 layout
(surge/model/quant/wna16.py), so the int GEMM serves them on CUDA (act-order as a gather of x's columns) and the
CPU dequantizes.

Per linear W [N out, K in]: qweight int32 [K * bits / 32, N] packed along K; qzeros int32 [K / group, N * bits / 32]
packed along N (v1: zero - 1); scales [K / group, N]; g_idx int32 [K], each input channel's group.
Act-order under tensor parallelism is refused: a row-parallel rank's input slice holds channels of any group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.distributed.parallel_state import get_tp_group
from surge.kernels.int_packing import repack_gptq_qweight, unpack_gptq_zeros
from surge.model.quant import QuantConfig, _group_size, _refuse, register_quant_method
from surge.model.quant.wna16 import RepackedWNA16Method

FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GPTQLinearMethod(RepackedWNA16Method):
    v1_zeros: bool = True
    name: str = "gptq"

    def create_weights(self, layer, device) -> None:
        tp = get_tp_group().world_size
        if self.act_order and tp > 1:
            raise _refuse("desc_act", True, f"false with tensor_parallel_size={tp} (act-order runs on one rank)")
        super().create_weights(layer, device)

    def convert(self, name: str, loaded: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        if name == "scales":
            return loaded.t()
        if name == "qzeros":
            return unpack_gptq_zeros(loaded, self.bits, loaded.shape[1] * (32 // self.bits), self.v1_zeros)
        return repack_gptq_qweight(loaded, self.bits, perm)

    def describe(self) -> str:
        return super().describe() + (", act-order" if self.act_order else "")


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, cfg: dict) -> None:
        bits = cfg.get("bits")
        if bits not in (4, 8):
            raise _refuse("bits", bits, "4, 8")
        group = _group_size(cfg.get("group_size", -1))
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in FORMATS:
            raise _refuse("checkpoint_format", fmt, ", ".join(map(repr, FORMATS)))
        if cfg.get("lm_head"):
            raise _refuse("lm_head", cfg["lm_head"], "false (Surge's LM head is unquantized)")
        if cfg.get("dynamic"):
            raise _refuse("dynamic", cfg["dynamic"], "none (per-module overrides are not supported)")
        act_order = bool(cfg.get("desc_act", False))
        self.ignore = tuple(cfg.get("modules_to_not_convert") or ())
        self.skip = () if act_order else ("g_idx",)  # in order without act-order: k // group
        self.method = GPTQLinearMethod(bits=bits, group_size=group, symmetric=bool(cfg.get("sym", True)),
                                       act_order=act_order, v1_zeros=fmt == "gptq")


register_quant_method("gptq", GPTQConfig)
