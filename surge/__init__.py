"""Surge: a compact, fast LLM inference and serving engine."""
from surge.entrypoints.llm import LLM
from surge.lora_request import LoRARequest
from surge.outputs import CompletionOutput, Logprob, RequestOutput
from surge.sampling_params import SamplingParams, StructuredOutputsParams
from surge.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
