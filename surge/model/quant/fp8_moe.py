"""FP8 (e4m3) experts for FusedMoE: weights in blocks (DeepSeek / Qwen3-FP8: 128x128, activations quantized
dynamically per 1 x 128 group) or per output channel (activations per token), as HF's `fp8` and compressed-tensors'
FP8_BLOCK / FP8_DYNAMIC checkpoints store them per expert, or quantized per channel as a bf16 checkpoint loads
(`--quantization fp8`).

Storage, this rank's experts: gate_up_proj float8_e4m3fn [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]; their
scales named as the checkpoint's (`gate_up_proj_weight_scale_inv` for HF's `weight_scale_inv`): blocks
[E, 2 * I / bn, H / bk] (gate's block rows, then up's) and [E, H / bn, I / bk], per channel [E, 2I, 1] and [E, H, 1].
CUDA: the fused MoE kernels' fp8 variants (MoeQuant "fp8_block" | "fp8_channel"; 128x128 blocks). Elsewhere the
weights are dequantized once and the activations' quantization simulated (quantize, dequantize) around each GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.kernels.quant_reference import FP8_DTYPE as FP8
from surge.kernels.quant_reference import FP8_MAX
from surge.kernels.quant_reference import FP8_MIN_SCALE as MIN_SCALE
from surge.kernels.quant_reference import dequantize_fp8, fp8_fake_quant
from surge.model.quant.base import MoEMethod, Sharding, add_expert_param

PROJECTIONS = ("gate_up_proj", "down_proj")


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
            if i % bn:
                raise ValueError(f"fp8 {bn}x{bk} block experts: this rank's intermediate size {i} is not a multiple "
                                 f"of the block's {bn} rows (gate's blocks and up's are stacked)")
            shapes = ((e, 2 * i // bn, -(-h // bk)), (e, -(-h // bn), -(-i // bk)))
            sharding = Sharding(bn, bk)
        else:  # per row, one column: not split along the input
            shapes, sharding = ((e, 2 * i, 1), (e, h, 1)), Sharding(1, None)
        for proj, shape in zip(PROJECTIONS, shapes):
            add_expert_param(layer, f"{proj}_{self.scale_name}", shape, torch.float32, sharding, device=device)
            if self.online:
                getattr(layer, proj).on_load = self._quantize_on_load(layer, proj)
                getattr(layer, f"{proj}_{self.scale_name}").loaded_with = proj  # written by the weight's on_load

    def _scales(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(getattr(layer, f"{proj}_{self.scale_name}") for proj in PROJECTIONS)

    def _quantize_on_load(self, layer, proj: str):
        def on_load(param: torch.nn.Parameter, index: tuple, source: torch.Tensor) -> None:
            """Unquantized rows of one expert or of every expert, [..., rows, cols]: each row scaled on its own."""
            rows = source.to(param.device, torch.float32)
            scale = (rows.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
            param.data[index] = (rows / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
            getattr(layer, f"{proj}_{self.scale_name}").data[index] = scale
        return on_load

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        for proj, scale in zip(PROJECTIONS, self._scales(layer)):
            weight = getattr(layer, proj)
            dense = torch.empty(weight.shape, device=weight.device).normal_(0.0, 0.02, generator=gen)
            scale.data.fill_(0.02 * 4 / FP8_MAX)  # about 4 standard deviations at the top of the fp8 range
            expanded = scale if self.block is None else scale.repeat_interleave(self.block[0], 1).repeat_interleave(
                self.block[1], 2)[:, :dense.shape[1], :dense.shape[2]]
            weight.data.copy_((dense / expanded).clamp_(-FP8_MAX, FP8_MAX).to(FP8))

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantize_fp8(getattr(layer, proj), scale, self.block, layer.params_dtype)
                     for proj, scale in zip(PROJECTIONS, self._scales(layer)))

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              **options) -> torch.Tensor:
        if x.is_cuda:
            from surge.kernels.fused_moe import FP8_BLOCK, MoeQuant, fused_moe
            if self.block is not None and tuple(self.block) != (FP8_BLOCK, FP8_BLOCK):
                raise ValueError(f"fp8 {self.block[0]}x{self.block[1]} block experts: the fused MoE kernel takes "
                                 f"{FP8_BLOCK}x{FP8_BLOCK} blocks")
            gate_up_scale, down_scale = self._scales(layer)
            if self.block is None:
                gate_up_scale, down_scale = gate_up_scale.squeeze(-1), down_scale.squeeze(-1)
            quant = MoeQuant("fp8_block" if self.block else "fp8_channel", gate_up_scale, down_scale)
            return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids,
                             expert_offset=layer.expert_start, quant=quant, **options)
        from surge.kernels.reference import fused_moe as fused_moe_reference
        scheme, group = ("group", self.block[1]) if self.block else ("token", 128)

        def activation_quant(rows: torch.Tensor, _: str) -> torch.Tensor:
            return fp8_fake_quant(rows, scheme, None, group).to(rows.dtype)

        gate_up, down = self._dequantized(layer)
        return fused_moe_reference(x, gate_up, down, topk_weights, layer.local_expert_ids(topk_ids),
                                   activation_quant=activation_quant, **options)

    def _dequantized(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts in the activations' dtype, dequantized once (again after the weights change)."""
        key = tuple((getattr(layer, p)._version, s._version) for p, s in zip(PROJECTIONS, self._scales(layer)))
        cached = layer.__dict__.get("_fp8_dequantized")
        if cached is None or cached[0] != key:
            cached = layer.__dict__["_fp8_dequantized"] = (key, self.dense_weights(layer))
        return cached[1]
