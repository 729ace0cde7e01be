"""LoRAManager: a model runner's adapters. It attaches slot pools to the model's linear layers, keeps up to
max_cpu_loras adapters loaded in host memory and max_loras in the device's slots (each least recently used first
out), and maps each step's tokens to their adapter's slot.

The scheduler puts at most max_loras distinct adapters in one step, so a step's adapters always fit the slots.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import nn

from surge.config import LoRAConfig
from surge.lora.peft import LoRAAdapter, is_adaptable, load_adapter
from surge.lora_request import LoRARequest
from surge.model.layers.lora import LinearLoRA, LoRAMapping


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.mapping = LoRAMapping(max_tokens, config.max_loras, device)
        self.layers: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if is_adaptable(module):
                module.lora = LinearLoRA(module.in_features, module.lora_slices(), config.max_loras,
                                         config.max_lora_rank, self.mapping, dtype, device)
                self.layers[name] = module.lora
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host memory, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recently used first
        self.free_slots = list(reversed(range(config.max_loras)))

    def warm_up(self) -> float:
        """Compile the LoRA kernels for every distinct layer shape, at each of the launch policy's paths (fused,
        split with decode tiles, prefill tiles)."""
        from surge.kernels.lora import WARM_UP_TOKEN_COUNTS

        start = time.perf_counter()
        shapes = {}
        for layer in self.layers.values():
            shapes.setdefault((tuple(layer.a.shape), tuple(layer.b.shape), tuple(layer.slices)), layer)
        for layer in shapes.values():
            for num_tokens in WARM_UP_TOKEN_COUNTS:
                layer.warm_up(num_tokens, self.dtype)
        return time.perf_counter() - start

    def set_step(self, requests: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """The step's requests' adapters (in step order) into slots, and their tokens' mapping."""
        self.mapping.set(self.activate(requests), num_tokens)

    def activate(self, requests: list[LoRARequest | None]) -> list[int]:
        """Each request's slot (-1: none), loading adapters that are not in one."""
        needed = {r.lora_int_id: r for r in requests if r is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step holds {len(needed)} adapters, more than max_loras={self.config.max_loras}")
        for lora_id, request in needed.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            slot = self.free_slots.pop() if self.free_slots else self._evict(needed)
            adapter = self.adapter(request)
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.layers.get(name, {}))
            self.slot_of[lora_id] = slot
        return [-1 if r is None else self.slot_of[r.lora_int_id] for r in requests]

    def _evict(self, keep: dict[int, LoRARequest]) -> int:
        victim = next(lora_id for lora_id in self.slot_of if lora_id not in keep)
        return self.slot_of.pop(victim)

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its directory when it is not."""
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is not None:
            self.loaded.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request.lora_path, self.model, self.config.max_lora_rank, self.dtype)
        self.loaded[request.lora_int_id] = adapter
        while len(self.loaded) > self.config.cpu_capacity:
            self.loaded.popitem(last=False)
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot is free again."""
        self.loaded.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
