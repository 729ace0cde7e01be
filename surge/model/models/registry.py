"""Architecture name (config.json `architectures`) -> model class. `python -m surge.model.models` prints the
README's table of supported architectures (a test checks the README holds exactly that)."""
from __future__ import annotations

from torch import nn

from surge.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from surge.model.models.qwen3_moe import Qwen3MoeForCausalLM
from surge.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from surge.model.models.gpt_oss import GptOssForCausalLM
from surge.model.models.mistral import MistralForCausalLM
from surge.model.models.mixtral import MixtralForCausalLM
from surge.model.models.qwen2_moe import Qwen2MoeForCausalLM
from surge.model.models.smollm3 import SmolLM3ForCausalLM
from surge.model.models.granite import GraniteForCausalLM
from surge.model.models.exaone4 import Exaone4ForCausalLM
from surge.model.models.phi import PhiForCausalLM
from surge.model.models.phi3 import Phi3ForCausalLM
from surge.model.models.stablelm import StableLmForCausalLM
from surge.model.models.gpt_neox import GPTNeoXForCausalLM
from surge.model.models.starcoder2 import Starcoder2ForCausalLM
from surge.model.models.olmo import Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoForCausalLM
from surge.model.models.olmoe import OlmoeForCausalLM
from surge.model.models.cohere import CohereForCausalLM
from surge.model.models.glm import Glm4ForCausalLM, GlmForCausalLM
from surge.model.models.ernie4_5 import Ernie4_5ForCausalLM
from surge.model.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from surge.model.models.deepseek_v4 import DeepseekV4ForCausalLM
from surge.model.models.deepseek_mtp import DeepseekMTP
from surge.model.models.deepseek_v4_mtp import DeepseekV4MTP
from surge.model.models.llava import LlavaForConditionalGeneration
from surge.model.models.gemma3_mm import Gemma3ForConditionalGeneration
from surge.model.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from surge.model.models.pooling import as_pooling_model

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}

# The draft of speculative_config method "deepseek_mtp": the architecture's multi-token-prediction layers.
MTP_MODELS: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekMTP,
    "DeepseekV4ForCausalLM": DeepseekV4MTP,
}


# Every family also serves as a pooling model (runner "pooling"): its `*ForSequenceClassification` (a score head) and
# its bare `*Model` (hidden states, as sentence-transformers saves it) name the family's pooling class.
POOLING_ARCHITECTURES: dict[str, str] = {
    arch.replace("ForCausalLM", suffix): arch for arch in MODEL_REGISTRY if arch.endswith("ForCausalLM")
    for suffix in ("ForSequenceClassification", "Model")}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*MODEL_REGISTRY, *POOLING_ARCHITECTURES)


def get_model_class(architecture: str, runner: str = "generate") -> type[nn.Module]:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}, "
                         "and each family's *ForSequenceClassification and *Model for runner='pooling'")
    if runner == "pooling":
        return _pooling_class(POOLING_ARCHITECTURES.get(architecture, architecture))
    return MODEL_REGISTRY[architecture]


_POOLING_CLASSES: dict[str, type[nn.Module]] = {}


def _pooling_class(causal_arch: str) -> type[nn.Module]:
    """One pooling class per family, made on first use."""
    if causal_arch not in _POOLING_CLASSES:
        _POOLING_CLASSES[causal_arch] = as_pooling_model(MODEL_REGISTRY[causal_arch])
    return _POOLING_CLASSES[causal_arch]


def get_mtp_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MTP_MODELS:
        raise ValueError(f"speculative_config.method='deepseek_mtp' needs a model with MTP layers; {architecture} has "
                         f"none that Surge runs (supported: {', '.join(MTP_MODELS)})")
    return MTP_MODELS[architecture]


def architectures_markdown() -> str:
    """The README's table: each registered architecture and the file implementing it."""
    rows = ["| architecture (config.json `architectures`) | model file |", "|---|---|"]
    for arch, cls in sorted(MODEL_REGISTRY.items()):
        rows.append(f"| `{arch}` | `surge/model/models/{cls.__module__.rsplit('.', 1)[1]}.py` |")
    return "\n".join(rows) + "\n"
