"""LoRARequest: which adapter a request runs with, as vLLM names it (`LoRARequest(lora_name, lora_int_id, lora_path)`).

It crosses processes with the request (a msgspec Struct), and its name keys the prefix cache: the same prompt under
two adapters never shares KV blocks.
"""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """lora_name: unique per adapter; lora_int_id: a positive id, unique per adapter (the slot pool's key);
    lora_path: a local directory holding a PEFT adapter (adapter_config.json, adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model the adapter was trained on, as the server reports it

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an integer > 0")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r}: the adapter's local directory is required")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> tuple[str, int]:
        """What the prefix-cache block hash carries of the adapter."""
        return (self.lora_name, self.lora_int_id)
