"""The architecture contract: what a model class owns and the runner, the scheduler and the loaders ask it for.

A model is built from its ModelConfig; its linear layers then get their quantization's methods by checkpoint name
(surge/model/quant: `build_model` defers their weights and `quantize_model` creates them). It declares, for the rest
of the engine:
- `check_parallel(config, parallel)`: whether tensor/expert parallelism can split it, with errors naming the field;
- `attention_layers()`: its Attention layers in order; each binds its parameters (heads, scale, window, soft-cap,
  sinks) and declares its KV cache spec, from which the runner builds the KV cache groups and the kernel warm-up;
- `weight_mapper`: a declarative map of checkpoint tensor names to its parameters (prefixes, renames, skips, packed
  q/k/v and gate/up fragments; fused checkpoint tensors split by the packed layer's own loader);
- `forward(input_ids, positions, meta)` -> hidden states and `compute_logits(hidden)`.
Config fields that change the math are read through `cfg_*` helpers that refuse what they do not know, by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from surge.attention.backend import AttentionBackend, AttentionMetadata
from surge.config import ModelConfig, ParallelConfig
from surge.model.layers.attention import Attention
from surge.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

ShardId = Any  # "q" / "k" / "v", 0 / 1, an expert's (projection, index) ...


@dataclass(frozen=True)
class WeightMapper:
    """Checkpoint tensor name -> (parameter name, shard id), or None to skip it. Applied in order: `skip` (regexes on
    the checkpoint name), the first matching `prefixes` rename (old -> new prefix), `renames` (regex -> replacement,
    each applied once), then `packed` fragments (".q_proj." -> ".qkv_proj." with shard "q")."""
    prefixes: tuple[tuple[str, str], ...] = (("model.", ""),)
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)
    packed: dict[str, tuple[str, ShardId]] = field(default_factory=dict)

    def map(self, name: str) -> tuple[str, ShardId] | None:
        if any(re.search(pattern, name) for pattern in self.skip):
            return None
        for old, new in self.prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name, count=1)
        for ckpt, (param, shard_id) in self.packed.items():
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{param}.", 1), shard_id
        return name, None

    def extend(self, *, prefixes: tuple[tuple[str, str], ...] = (), renames: tuple[tuple[str, str], ...] = (),
               skip: tuple[str, ...] = (), packed: dict | None = None) -> WeightMapper:
        """This mapper with more rules (earlier prefixes first, renames and skips appended, packed merged)."""
        return WeightMapper(prefixes + self.prefixes, self.renames + renames, self.skip + skip,
                            {**self.packed, **(packed or {})})


LLAMA_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# FP8 KV cache scales onto the Attention layer's k_scale / v_scale, as vLLM accepts them: compressed-tensors'
# `self_attn.k_proj.output_scale`, ModelOpt's `self_attn.k_proj.k_scale`, and `self_attn.k_scale` (llm-compressor,
# HF); `self_attn.attn.k_scale` is the layer's own name.
KV_SCALE_RENAMES = ((r"\.([kv])_proj\.output_scale$", r".attn.\1_scale"),
                    (r"\.([kv])_proj\.\1_scale$", r".attn.\1_scale"),
                    (r"(?<!\.attn)\.([kv])_scale$", r".attn.\1_scale"))


# ---- reading the config: every field that changes the math is read here or by the model, or refused ----

def cfg_get(tc: Any, name: str, default: Any = None) -> Any:
    value = getattr(tc, name, None)
    return default if value is None else value


def refuse(field_name: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config field {field_name}={value!r} is not supported; supported: {supported}")


def require(tc: Any, field_name: str, allowed: tuple, default: Any = None) -> Any:
    """The field's value when it is one the model implements, else a ValueError naming it."""
    value = cfg_get(tc, field_name, default)
    if value not in allowed:
        raise refuse(field_name, value, ", ".join(map(repr, allowed)))
    return value


def head_dim(tc: Any) -> int:
    return cfg_get(tc, "head_dim") or tc.hidden_size // tc.num_attention_heads


def num_kv_heads(tc: Any) -> int:
    return cfg_get(tc, "num_key_value_heads") or tc.num_attention_heads


# ---- the base class ----

class CausalLM(nn.Module):
    """A decoder-only language model: an embedding, `layers`, a final norm and an LM head (possibly tied)."""
    weight_mapper: ClassVar[WeightMapper] = WeightMapper(renames=KV_SCALE_RENAMES, packed=LLAMA_PACKED)

    def __init__(self, config: ModelConfig, quant_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.tc = config.text_config
        self.tie_word_embeddings = bool(cfg_get(self.tc, "tie_word_embeddings", False))

    def make_lm_head(self, embed: VocabParallelEmbedding) -> ParallelLMHead:
        head = ParallelLMHead(self.tc.vocab_size, self.tc.hidden_size)
        if self.tie_word_embeddings:
            head.weight = embed.weight
        return head

    @classmethod
    def check_parallel(cls, config: ModelConfig, parallel: ParallelConfig) -> None:
        """KV heads (each with its query heads) split over the ranks, unevenly if need be, or are replicated when tp
        exceeds them; the MLP must split evenly, and so must the experts (their count with expert parallelism, each
        one's intermediate size without)."""
        tp, tc = parallel.tensor_parallel_size, config.text_config
        heads, kv_heads = tc.num_attention_heads, num_kv_heads(tc)
        if tp > kv_heads and (tp % kv_heads or heads % tp):
            raise ValueError(f"tensor_parallel_size={tp} exceeds the model's num_key_value_heads={kv_heads}: it must "
                             f"be a multiple of them and divide num_attention_heads={heads}")
        intermediate = cfg_get(tc, "intermediate_size")
        if intermediate is not None and intermediate % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's intermediate_size={intermediate}")
        num_experts = config.num_experts
        if parallel.enable_expert_parallel and num_experts and num_experts % tp:
            raise ValueError(f"enable_expert_parallel with tensor_parallel_size={tp}: the model's {num_experts} "
                             "experts do not split evenly over the ranks")
        moe_intermediate = cfg_get(tc, "moe_intermediate_size", intermediate)
        if num_experts and not parallel.enable_expert_parallel and moe_intermediate % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's moe_intermediate_size="
                             f"{moe_intermediate} (with --enable-expert-parallel each rank holds whole experts "
                             "instead)")

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def checkpoint_name_to_param(self, name: str) -> tuple[str, ShardId] | None:
        """Map a checkpoint tensor name to (parameter name, shard id); None for tensors to skip."""
        mapped = self.weight_mapper.map(name)
        if mapped is not None and mapped[0] == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return mapped

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: list[AttentionMetadata]) -> torch.Tensor:
        raise NotImplementedError

    def warm_up_kernels(self, backend: AttentionBackend, device: torch.device, block_size: int,
                        max_workers: int) -> int:
        """Compile the kernels the model launches itself (beyond its attention backend's, which warms up its own),
        before serving or capturing; returns how many variants were compiled. None here."""
        return 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [n, V]; with tensor parallelism on rank 0 only (None elsewhere)."""
        return self.lm_head(hidden)
