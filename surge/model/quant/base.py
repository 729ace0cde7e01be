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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from surge.model.layers.linear import Linear


@dataclass(frozen=True)
class Sharding:
    out_div: int | None = 1
    in_div: int | None = 1
    scalar: bool = False
    reduce_max: bool = False


WEIGHT = Sharding()


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

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        """Random weights for benchmarks (small normal values), in this method's storage."""
        layer.weight.normal_(0.0, 0.02, generator=gen)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The weight this method applies, [out, in] in the activations' dtype (references, the CPU path)."""
        return layer.weight


UNQUANTIZED = LinearMethod()
