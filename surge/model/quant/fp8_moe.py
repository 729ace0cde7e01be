"""FP8 (e4m3) experts for FusedMoE: weights in blocks (DeepSeek / Qwen3-FP8: 128x128, activations quantized
dynamically per 1 x 128 group) or per output channel (activations per token), as HF's `fp8` and compressed-tensors'
FP8_BLOCK / FP8_DYNAMIC checkpoints store them per expert, or quantized per channel as a bf16 checkpoint loads
(`--quantization fp8`).

Storage, this rank's experts: gate_up_proj float8_e4m3fn [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]; their
scales named as the checkpoint's (`gate_up_proj_weight_scale_inv` for HF's `weight_scale_inv`): blocks
[E, 2 * I / bn, H / bk] (gate's block rows, then up's) and [E, H / bn, I / bk], per channel [E, 2I, 1] and [E, H, 1].
CUDA: the fused MoE kernels' fp8 variants (MoeQuant "fp8_block" | "fp8_channel"; blocks of any row count and a
power-of-two column count >= 32, 128x128 in the checkpoints). Elsewhere the
weights are dequantized once and the activations' quantization simulated (quantize, dequantize) around each GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.quant_reference import FP8_DTYPE as FP8
from surge.kernels.quant_reference import FP8_MAX, dequantize_fp8, expand_blocks, fp8_fake_quant, saturate_fp8
from surge.model.quant.base import EXPERT_WEIGHTS, MoEMethod, Sharding, add_expert_param
from surge.model.quant.fp8 import quantize_weight


@dataclass(frozen=True)
class Fp8MoEMethod(MoEMethod):
    """weights: "block" (with `block` (bn, bk)) or "channel"; scale_name: the checkpoint's (weight_scale_inv or
    weight_scale); online: the checkpoint holds unquantized experts, quantized per channel as they load."""
    weights: str = "channel"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    online: bool = False
    name: str = "fp8"

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"fp8 {self.weights}{block} experts" + (" (online)" if self.online else "")

    def create_weights(self, layer, device) -> None:
        e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden
        add_expert_param(layer, "gate_up_proj", (e, 2 * i, h), FP8, device=device)
        add_expert_param(layer, "down_proj", (e, h, i), FP8, device=device)
        if self.weights == "block":
            bn, bk = self.block
            from surge.kernels.fused_moe import fp8_block_fits
            if device is not None and torch.device(device).type == "cuda" and not fp8_block_fits((bn, bk)):
                raise ValueError(f"fp8 {bn}x{bk} block experts: the fused MoE kernels take blocks whose column "
                                 f"count is a power of two >= 32")
            if i % bn:
                raise ValueError(f"fp8 {bn}x{bk} block experts: this rank's intermediate size {i} is not a multiple "
                                 f"of the block's {bn} rows (gate's blocks and up's are stacked)")
            shapes = ((e, 2 * i // bn, -(-h // bk)), (e, -(-h // bn), -(-i // bk)))
            sharding = Sharding(bn, bk)
        else:  # per row, one column: not split along the input
            shapes, sharding = ((e, 2 * i, 1), (e, h, 1)), Sharding(1, None)
        for proj, shape in zip(EXPERT_WEIGHTS, shapes):
            add_expert_param(layer, f"{proj}_{self.scale_name}", shape, torch.float32, sharding, device=device)
            if self.online:
                getattr(layer, proj).on_load = self._quantize_on_load(layer, proj)
                getattr(layer, f"{proj}_{self.scale_name}").loaded_with = proj  # written by the weight's on_load

    def _scales(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(getattr(layer, f"{proj}_{self.scale_name}") for proj in EXPERT_WEIGHTS)

    def _quantize_on_load(self, layer, proj: str):
        def on_load(param: torch.nn.Parameter, index: tuple, source: torch.Tensor) -> None:
            """Unquantized rows of one expert or of every expert, [..., rows, cols]: each row scaled on its own."""
            q, scale = quantize_weight(source.to(param.device), "channel", None)
            param.data[index] = q
            getattr(layer, f"{proj}_{self.scale_name}").data[index] = scale
        return on_load

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        for proj, scale in zip(EXPERT_WEIGHTS, self._scales(layer)):
            weight = getattr(layer, proj)
            dense = torch.empty(weight.shape, device=weight.device).normal_(0.0, 0.02, generator=gen)
            scale.data.fill_(0.02 * 4 / FP8_MAX)  # about 4 standard deviations at the top of the fp8 range
            expanded = scale if self.block is None else expand_blocks(scale, self.block, *dense.shape[-2:])
            weight.data.copy_(saturate_fp8(dense / expanded))

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantize_fp8(getattr(layer, proj), scale, self.block, layer.params_dtype)
                     for proj, scale in zip(EXPERT_WEIGHTS, self._scales(layer)))

    def kernel_weights(self, layer):
        from surge.kernels.fused_moe import MoeQuant
        gate_up_scale, down_scale = self._scales(layer)
        if self.block is None:
            return layer.gate_up_proj, layer.down_proj, MoeQuant("fp8_channel", gate_up_scale.squeeze(-1),
                                                                 down_scale.squeeze(-1))
        quant = MoeQuant("fp8_block", gate_up_scale, down_scale, block=tuple(self.block))
        return layer.gate_up_proj, layer.down_proj, quant

    def activation_quant(self):
        """Dynamic, per 1 x bk group with block weights, else per token."""
        scheme, group = ("group", self.block[1]) if self.block else ("token", 128)

        def simulate(rows: torch.Tensor, _: str) -> torch.Tensor:
            return fp8_fake_quant(rows, scheme, None, group).to(rows.dtype)
        return simulate
