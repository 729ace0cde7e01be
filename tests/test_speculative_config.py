"""The draft model's configs are derived by copy: every ParallelConfig field has a policy (a field added without one
fails here), the draft inherits what the issue says it must (expert parallelism, node layout, ports), and bad
speculative settings are refused with the field named."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from surge.config import DRAFT_PARALLEL_POLICY, ModelConfig, ParallelConfig, SpeculativeConfig


def unpoliced_fields(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in DRAFT_PARALLEL_POLICY]


def test_every_parallel_field_has_a_policy():
    assert unpoliced_fields(ParallelConfig) == []
    for name, (policy, why) in DRAFT_PARALLEL_POLICY.items():
        assert policy in ("inherit", "override") and why, name
    assert set(DRAFT_PARALLEL_POLICY) == {f.name for f in dataclasses.fields(ParallelConfig)}  # no stale entry


def test_a_new_field_without_a_policy_is_caught():
    """The walk above, on a ParallelConfig that grew a field: it must name the field."""
    grown = dataclasses.make_dataclass("GrownParallelConfig", [("pipeline_parallel_size", int, 1)],
                                       bases=(ParallelConfig,), frozen=True)
    assert unpoliced_fields(grown) == ["pipeline_parallel_size"]


def test_the_draft_inherits_everything_but_its_tensor_parallel_size():
    one_node = ParallelConfig(tensor_parallel_size=4, master_addr="10.0.0.1", master_port=29500,
                              enable_expert_parallel=True)
    two_nodes = dataclasses.replace(one_node, nnodes=2, node_rank=1)
    spec = SpeculativeConfig("draft_model", 3, model="/models/draft", draft_tensor_parallel_size=1)
    for target, size in ((one_node, 1), (two_nodes, 4)):
        draft = (spec if size == 1 else dataclasses.replace(spec, draft_tensor_parallel_size=None)
                 ).draft_parallel_config(target)
        for f in dataclasses.fields(ParallelConfig):
            policy, _ = DRAFT_PARALLEL_POLICY[f.name]
            if policy == "inherit":
                assert getattr(draft, f.name) == getattr(target, f.name), f.name
        assert draft.tensor_parallel_size == size and draft.enable_expert_parallel
    assert SpeculativeConfig("ngram", 2).draft_parallel_config(two_nodes) == two_nodes  # None: the target's size
    with pytest.raises(ValueError, match="needs a draft on all its ranks"):
        spec.draft_parallel_config(two_nodes)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 must be 1 or the target's"):
        SpeculativeConfig("draft_model", 3, model="/d", draft_tensor_parallel_size=2).draft_parallel_config(target)


def _model_config(vocab: int, layers: int) -> ModelConfig:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": layers,
           "num_attention_heads": 4, "vocab_size": vocab, "intermediate_size": 128, "max_position_embeddings": 512}
    return ModelConfig.from_hf_config("/m", cfg, {}, "float32", torch.device("cpu"),
                                      supported_architectures=["LlamaForCausalLM"])


def test_the_draft_model_keeps_its_architecture_and_takes_the_targets_dtype_and_length():
    target = dataclasses.replace(_model_config(1000, 8), dtype=torch.bfloat16, max_model_len=300,
                                 load_format="dummy")
    draft = SpeculativeConfig("draft_model", 2, model="/d").draft_model_config(target, _model_config(1000, 2))
    assert draft.num_layers == 2 and draft.dtype == torch.bfloat16 and draft.max_model_len == 300
    assert draft.load_format == "dummy"
    with pytest.raises(ValueError, match="must share the tokenizer"):
        SpeculativeConfig("draft_model", 2, model="/d").draft_model_config(target, _model_config(999, 2))


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="eagle", num_speculative_tokens=2), "method='eagle' is not supported"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens=0 must be an integer in"),
    (dict(method="ngram", num_speculative_tokens=True), "num_speculative_tokens=True"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "1 <= min <= max"),
    (dict(method="draft_model", num_speculative_tokens=2), "must name the draft model's directory"),
    (dict(method="ngram", num_speculative_tokens=2, model="/d"), "'ngram' uses no model"),
])
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)
