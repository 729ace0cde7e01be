"""Architecture name (config.json `architectures`) -> model class. `python -m surge.model.models` prints the
README's table of supported architectures (a test checks the README holds exactly that)."""
from __future__ import annotations

from torch import nn

from surge.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM
from surge.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from surge.model.models.gpt_oss import GptOssForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


def architectures_markdown() -> str:
    """The README's table: each registered architecture and the file implementing it."""
    rows = ["| architecture (config.json `architectures`) | model file |", "|---|---|"]
    for arch, cls in sorted(MODEL_REGISTRY.items()):
        rows.append(f"| `{arch}` | `surge/model/models/{cls.__module__.rsplit('.', 1)[1]}.py` |")
    return "\n".join(rows) + "\n"
