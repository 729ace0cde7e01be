"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules name=path` (or JSON `{"name", "path",
"base_model_name"}`) served by name as a request's `model`, listed by /v1/models with `parent` = the base model, and
added or removed at runtime by `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `/v1/unload_lora_adapter
{"lora_name"}`. Runtime updates read server-side paths, so they exist only when SURGE_ALLOW_RUNTIME_LORA_UPDATING
(or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) is set; otherwise both routes answer 404, as vLLM's are absent.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from surge import envs
from surge.entrypoints.openai.errors import APIError, bad_request
from surge.entrypoints.openai.guard import read_json
from surge.entrypoints.openai.serving import OpenAIServing
from surge.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """`name=path` or a JSON object {"name", "path", "base_model_name"?} per value."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str) or set(spec) - {"name", "path", "base_model_name"}:
                raise ValueError(f"--lora-modules {value!r}: a JSON module is {{\"name\": ..., \"path\": ..., "
                                 "\"base_model_name\": ... (optional)}")
            modules.append(LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r} must be name=path or a JSON object")
        modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be unique, got {names}")
    return modules


class LoadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed() -> bool:
    return envs.SURGE_ALLOW_RUNTIME_LORA_UPDATING


class LoRAHandler:
    def __init__(self, serving: OpenAIServing, base_model_name: str) -> None:
        self.serving = serving
        self.base_model_name = base_model_name
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve an adapter under `name` (checked against the model first: a ValueError says what is wrong)."""
        s = self.serving
        if s.engine.config.lora_config is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if name in s.loras or name in s.model_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, next(self._ids), path, base_model_name or self.base_model_name)
        s.engine.adapters.check(request)
        s.loras[name] = request
        return request

    def _check_allowed(self) -> None:
        if not runtime_updates_allowed():
            raise APIError(404, "runtime LoRA updates are disabled: start the server with "
                           "SURGE_ALLOW_RUNTIME_LORA_UPDATING=1 to load and unload adapters", code="not_found")

    async def load(self, request: Request) -> Response:
        self._check_allowed()
        if self.serving.engine.config.lora_config is None:
            raise bad_request("LoRA adapters need a server started with --enable-lora")
        body = await read_json(request, self.serving.limits, LoadLoRAAdapterRequest)
        if not body.lora_name or not body.lora_path:
            raise bad_request("both 'lora_name' and 'lora_path' must be provided", param="lora_name")
        try:
            self.add(body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._check_allowed()
        body = await read_json(request, self.serving.limits, UnloadLoRAAdapterRequest)
        lora = self.serving.loras.pop(body.lora_name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        self.serving.engine.adapters.forget(lora)
        await self.serving.engine.remove_lora(lora.lora_int_id)  # the workers free its slot
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
