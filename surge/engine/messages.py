"""What crosses the ZMQ sockets between the front end (AsyncLLM) and the EngineCore process: msgspec msgpack
Structs only, never pickle. Requests go in as one tagged union; every answer comes back as EngineCoreOutputs.
"""
from __future__ import annotations

from typing import Any

import msgspec

from surge.engine.core import EngineCoreOutput, SchedulerStats
from surge.lora_request import LoRARequest
from surge.multimodal import MultiModalFeature
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # one sample: n > 1 is fanned out by the front end
    pooling_params: PoolingParams | None = None  # a pooling request (params: the prompt only)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    mm_features: list[MultiModalFeature] = []  # its images, processed by the front end


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class StopRequests(msgspec.Struct, tag="stop", array_like=True):
    """The front end found a stop string: finish these as "stop", not "abort"."""
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: str  # one of core_proc.UTILITY_METHODS
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreRequest = AddRequest | AbortRequests | StopRequests | UtilityCall | Shutdown


class RequestFailure(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    invalid_request: bool  # True: the request itself was refused (a 4xx); False: the engine failed (a 5xx)


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    failures: list[RequestFailure] = []
    utility_results: list[UtilityResult] = []


class CoreReady(msgspec.Struct, array_like=True):
    """Sent once over the start-up pipe: the model is loaded and the loop is about to run, or why not."""
    error: str | None = None
    num_kv_blocks: int = 0
