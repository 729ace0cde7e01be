"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from surge.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM
from surge.model.models.olmo import Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoForCausalLM
from surge.model.models.olmoe import OlmoeForCausalLM
from surge.model.models.cohere import CohereForCausalLM
from surge.model.models.glm import Glm4ForCausalLM, GlmForCausalLM
from surge.model.models.ernie4_5 import Ernie4_5ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]
