"""The quantization seam: a linear layer holds a LinearMethod, which creates the parameters a checkpoint holds for it
(weights, scales, zero points), says how each is sharded, and applies the GEMM. Unquantized is the first method.

A parameter's `sharding` tells the layer's loader how checkpoint elements map to its own along the two dimensions
the layer splits (output rows for column-parallel layers, input columns for row-parallel ones):
- `out_div` / `in_div`: checkpoint elements per parameter element (1 for a weight, the block for a block scale, 8
  for int4 packed along the input, the group for group scales); None: that dimension is not split (a per-row scale
  has one column whatever the rank's input slice);
- `scalar`: a checkpoint scalar (a per-tensor scale) fills every row of its shard (so q, k and v keep their own);
- `reduce_max`: one value for the whole layer (a static activation scale): the largest of the shards' values.
Parameters are created in their final layout, shapes known on the meta device, so the weight-cache daemon binds them
by name like any other; loaders convert what a format stores differently as it arrives.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from surge.kernels.fused_moe import MoeQuant
    from surge.model.layers.linear import Linear
    from surge.model.quant.quantized_input import InputQuant

T = TypeVar("T")


@dataclass(frozen=True)
class Sharding:
    out_div: int | None = 1
    in_div: int | None = 1
    scalar: bool = False
    reduce_max: bool = False


WEIGHT = Sharding()


def cached_on_layer(layer: nn.Module, slot: str, compute: Callable[[], T],
                    sources: tuple[torch.Tensor, ...] | None = None) -> T:
    """compute(), kept on the layer under `slot` and computed again only after one of the parameters it derives from
    (`sources`; None: all the layer's own) changed in place or was replaced: what a method derives from its stored
    weights (a dequantized copy, unpacked zero points, act-order's permutation) is made once, not per call. Naming
    the sources keeps a per-call check on the GPU path to one tensor."""
    if sources is None:
        sources = tuple(p for p in layer._parameters.values() if p is not None)
    key = tuple((p.data_ptr(), p._version) for p in sources)
    cached = layer.__dict__.get(slot)
    if cached is None or cached[0] != key:
        with torch.inference_mode(False):  # a tensor with a version counter, for the CPU GEMM's packed copy
            cached = layer.__dict__[slot] = (key, compute())
    return cached[1]


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              sharding: Sharding = WEIGHT, device: torch.device | None = None, fill: float | None = None) -> None:
    """Register a parameter the layer's weight loader fills."""
    data = torch.empty(shape, dtype=dtype, device=device)
    if fill is not None and data.device.type != "meta":
        data.fill_(fill)
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = layer.weight_loader
    param.sharding = sharding
    layer.register_parameter(name, param)


class LinearMethod:
    """How one linear layer stores and applies its weight. `layer.in_features` / `out_features` are this rank's
    sizes; `layer.params_dtype` the activations' dtype."""
    name = "unquantized"

    def describe(self) -> str:
        return self.name

    def create_weights(self, layer: Linear, device: torch.device | None) -> None:
        add_param(layer, "weight", (layer.out_features, layer.in_features), layer.params_dtype, device=device)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from surge.model.layers.gemm import linear
        return linear(x, layer.weight, bias, owner=layer)

    def input_quant(self, layer: Linear) -> InputQuant | None:
        """The quantization of its input this method does, which the layer producing the input may do instead in its
        own kernel (surge/model/quant/quantized_input.py); None: the method takes its input as it is."""
        return None

    def takes_quantized_input(self, layer: Linear, x: torch.Tensor) -> bool:
        """Whether this call (its producer's input x: rows, device, dtype) takes its input quantized by the producer
        (asked only of methods with an input_quant)."""
        return False

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        """Random weights for benchmarks (small normal values), in this method's storage."""
        layer.weight.normal_(0.0, 0.02, generator=gen)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The weight this method applies, [out, in] in the activations' dtype (references, the CPU path)."""
        return layer.weight

    def cached_dense_weight(self, layer: Linear) -> torch.Tensor:
        """dense_weight, computed once (for layers whose weight is read directly, as MLA's kv_b_proj; the dequantized
        CPU paths)."""
        if self is UNQUANTIZED:
            return layer.weight
        return cached_on_layer(layer, "_dense_weight", lambda: self.dense_weight(layer))

    def moe_method(self) -> MoEMethod:
        """This method's counterpart for a mixture-of-experts layer the config quantizes alike."""
        if self.name == "unquantized":
            return UNQUANTIZED_MOE
        raise ValueError(f"{self.describe()} experts are not supported: fused MoE layers take unquantized, fp8 "
                         "(block, or per-channel with dynamic per-token activations) or mxfp4 experts")


UNQUANTIZED = LinearMethod()


# ---- mixture-of-experts layers ----

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # a FusedMoE's weights, and the prefix of a quantized one's tensors


class MoEMethod:
    """How one FusedMoE layer (surge/model/layers/moe.py) stores and applies its experts' weights. Parameters are
    [E, rows, cols, ...] per expert: gate|up [E, 2I, H] ([gate | up] rows) and down [E, H, I], in this rank's
    experts and intermediate slice; a parameter's `sharding` counts checkpoint elements per parameter element along
    rows (out_div) and columns (in_div; None: one column whatever the split, a per-row scale). The experts' loader
    writes each checkpoint slice through the parameter's `on_load(param, index, source)` where it has one."""
    name = "unquantized"

    def describe(self) -> str:
        return self.name

    def create_weights(self, layer, device: torch.device | None) -> None:
        e, i, h = layer.num_local_experts, layer.local_intermediate, layer.hidden
        add_expert_param(layer, "gate_up_proj", (e, 2 * i, h), layer.params_dtype, device=device)
        add_expert_param(layer, "down_proj", (e, h, i), layer.params_dtype, device=device)

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              **options) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x); options: biases and the activation. CUDA: the fused MoE
        kernels on the stored weights (`kernel_weights`); elsewhere the torch reference on the dense weights,
        computed once, with the activations' quantization simulated around each GEMM (`activation_quant`)."""
        if x.is_cuda:
            return self.apply_kernels(layer, x, topk_weights, topk_ids, **options)
        from surge.kernels.reference import fused_moe as fused_moe_reference
        gate_up, down = self.cached_dense_weights(layer)
        return fused_moe_reference(x, gate_up, down, topk_weights, layer.local_expert_ids(topk_ids),
                                   activation_quant=self.activation_quant(), **options)

    def apply_kernels(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      **options) -> torch.Tensor:
        """apply's CUDA path (tests call it on CPU tensors: the kernels run in the interpreter). The kernels skip
        another rank's experts themselves: no id arithmetic launched here."""
        from surge.kernels.fused_moe import fused_moe
        if self.kernel_takes(x.dtype):
            gate_up, down, quant = self.kernel_weights(layer)
        else:  # the unquantized kernels on the dequantized experts: graph-safe, unlike the reference's loop
            (gate_up, down), quant = self.cached_dense_weights(layer), None
        return fused_moe(x, gate_up, down, topk_weights, topk_ids, expert_offset=layer.expert_start, quant=quant,
                         **options)

    def kernel_takes(self, dtype: torch.dtype) -> bool:
        """Whether the kernels' variant for these experts takes activations of `dtype`. Where it does not, CUDA runs
        the unquantized kernels on the dequantized experts (`cached_dense_weights`, as the CPU path): the weights
        exactly, so only for methods that leave the activations unquantized (activation_quant None)."""
        return True

    def kernel_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor, MoeQuant | None]:
        """(gate|up, down, their MoeQuant) as the fused MoE kernels take them."""
        return layer.gate_up_proj, layer.down_proj, None

    def activation_quant(self) -> Callable[[torch.Tensor, str], torch.Tensor] | None:
        """The quantization of each expert GEMM's input the kernels do, simulated (quantize, dequantize) on the
        reference path; None: the activations stay as they are."""
        return None

    def init_dummy(self, layer, gen: torch.Generator) -> None:
        layer.gate_up_proj.normal_(0.0, 0.02, generator=gen)
        layer.down_proj.normal_(0.0, 0.02, generator=gen)

    def dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [E, 2I, H], down [E, H, I]) in the activations' dtype (references, the CPU path)."""
        return layer.gate_up_proj, layer.down_proj

    def cached_dense_weights(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """dense_weights, computed once (the CPU path)."""
        if self is UNQUANTIZED_MOE:
            return self.dense_weights(layer)
        return cached_on_layer(layer, "_dense_weights", lambda: self.dense_weights(layer))


def add_expert_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     sharding: Sharding = WEIGHT, device: torch.device | None = None,
                     checkpoint_in_out: bool | None = None) -> None:
    """Register a FusedMoE parameter its expert loader fills. checkpoint_in_out: whether stacked checkpoint tensors
    hold it [E, cols, rows] (None: as the layer says of its checkpoint's weights)."""
    add_param(layer, name, shape, dtype, sharding, device)
    param = getattr(layer, name)
    param.weight_loader = layer.weight_loader
    if checkpoint_in_out is not None:
        param.checkpoint_in_out = checkpoint_in_out


UNQUANTIZED_MOE = MoEMethod()
