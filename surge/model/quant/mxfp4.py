"""MXFP4 experts (`quant_method: "mxfp4"`, gpt-oss): each expert's weights in blocks of 32 e2m1 values (two per
byte, the low nibble first) with one e8m0 scale (2^(s - 127)) per block; everything else (attention, router,
embeddings, LM head) stays unquantized, as the checkpoint's `modules_to_not_convert` says.

Checkpoint tensors, stacked per layer: mlp.experts.gate_up_proj_blocks uint8 [E, 2I, H / 32, 16] and
gate_up_proj_scales [E, 2I, H / 32] (gate and up rows interleaved, as the layer's biases), down_proj_blocks
[E, H, I / 32, 16] and down_proj_scales [E, H, I / 32]; stored in [gate | up] row order by the experts' loader.
CUDA: the fused MoE kernels' mxfp4 variant (decoded in registers, bf16 activations; other activation dtypes, as
float32 parity runs, the unquantized kernels on the dequantized experts). Elsewhere the experts are dequantized once
into the activations' dtype (exact: each value a power-of-two multiple of an e2m1 code).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.quant_reference import dequantize_mxfp4
from surge.model.quant import QuantConfig, register_quant_method
from surge.model.quant.base import (EXPERT_WEIGHTS, UNQUANTIZED, UNQUANTIZED_MOE, LinearMethod, MoEMethod, Sharding,
                                   add_expert_param)

BLOCK = 32


@dataclass(frozen=True)
class Mxfp4MoEMethod(MoEMethod):
    name: str = "mxfp4"

    def describe(self) -> str:
        return "mxfp4 experts"

    def create_weights(self, layer, device) -> None:
        e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden
        if h % BLOCK or i % BLOCK:
            raise ValueError(f"mxfp4 experts need the hidden size ({h}) and this rank's intermediate size ({i}) to be "
                             f"multiples of {BLOCK}")
        sharding = Sharding(1, BLOCK)  # one element per row; a block of 32 checkpoint elements per column
        for proj, (rows, cols) in zip(EXPERT_WEIGHTS, ((2 * i, h), (h, i))):
            add_expert_param(layer, f"{proj}_blocks", (e, rows, cols // BLOCK, 16), torch.uint8, sharding, device,
                             checkpoint_in_out=False)
            add_expert_param(layer, f"{proj}_scales", (e, rows, cols // BLOCK), torch.uint8, sharding, device,
                             checkpoint_in_out=False)

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        for proj in EXPERT_WEIGHTS:
            blocks, scales = getattr(layer, f"{proj}_blocks"), getattr(layer, f"{proj}_scales")
            blocks.data.copy_(torch.randint(0, 256, blocks.shape, generator=gen, device=blocks.device))
            scales.data.fill_(127 - 8)  # e2m1 values up to 6 / 256: about normal(0, 0.02) weights

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantize_mxfp4(getattr(layer, f"{proj}_blocks"), getattr(layer, f"{proj}_scales"),
                                      layer.params_dtype) for proj in EXPERT_WEIGHTS)

    def kernel_takes(self, dtype: torch.dtype) -> bool:
        """The mxfp4 variant decodes the weights to bf16 for bf16 tensor-core dots: bf16 activations. Others (float32
        parity runs) take the dequantized experts, exact in any float dtype."""
        return dtype == torch.bfloat16

    def kernel_weights(self, layer):
        from surge.kernels.fused_moe import MoeQuant
        quant = MoeQuant("mxfp4", layer.gate_up_proj_scales, layer.down_proj_scales)
        return layer.gate_up_proj_blocks, layer.down_proj_blocks, quant


class Mxfp4Config(QuantConfig):
    """Only the experts are MXFP4: every linear layer stays unquantized."""
    name = "mxfp4"

    def __init__(self, cfg: dict) -> None:
        self.ignore = tuple(cfg.get("modules_to_not_convert") or ())
        self.experts = Mxfp4MoEMethod()

    def method_for(self, module: str) -> LinearMethod:
        return UNQUANTIZED

    def moe_method_for(self, module: str) -> MoEMethod:
        return UNQUANTIZED_MOE if self.ignored(module) else self.experts

    def describe(self) -> str:
        return "mxfp4 experts"


register_quant_method("mxfp4", Mxfp4Config)
