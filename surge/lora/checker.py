"""AdapterChecker: the front ends' check of an adapter before a request carries it to the engine (rank, format, targets
against the model's layers), so a bad adapter is refused as that request's error, not a failed engine step."""
from __future__ import annotations

import torch

from surge.config import EngineConfig
from surge.distributed.parallel_state import layout_of_rank
from surge.lora.peft import load_adapter
from surge.lora_request import LoRARequest
from surge.model.loader.base import build_model


class AdapterChecker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._model = None  # built on the meta device (no weights) at the first check
        self._checked: dict[LoRARequest, int] = {}  # request -> its adapter's rank

    def check(self, request: LoRARequest) -> int:
        """The adapter's rank; ValueError naming what is wrong with it."""
        if self.config.lora_config is None:
            raise ValueError("a lora_request needs an engine started with enable_lora=True (--enable-lora)")
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        rank = self._checked.get(request)
        if rank is None:
            if self._model is None:
                with layout_of_rank(self.config.parallel_config, 0):
                    self._model = build_model(self.config.model_config, torch.device("meta"))
            adapter = load_adapter(request.lora_path, self._model, self.config.lora_config.max_lora_rank)
            rank = self._checked[request] = adapter.rank
        return rank

    def forget(self, request: LoRARequest) -> None:
        self._checked.pop(request, None)
