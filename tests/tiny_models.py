"""Tiny random-weight HF models (Llama, Llama with one KV head, Qwen3, hybrid Qwen3, Qwen3-MoE) saved as HF
directories, for fast tests.

Built with transformers itself from a config, so the weights and the reference forward pass are HF's own.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

VOCAB = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_config(kind: str):
    if kind == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0)
    if kind == "llama-tied":
        return LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})
    if kind == "llama-mqa":  # one KV head: tensor parallelism must replicate it
        return LlamaConfig(**{**_COMMON, "num_key_value_heads": 1})
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, rope_theta=1000000.0)
    if kind == "qwen3-hybrid":
        return Qwen3Config(**_COMMON, rope_theta=1000000.0, use_sliding_window=True, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    if kind == "qwen3-moe":  # 8 experts, 3 per token, renormalized; layer 2 dense (mlp_only_layers)
        return Qwen3MoeConfig(**_COMMON, rope_theta=1000000.0, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2])
    raise ValueError(kind)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer over the 256-token vocabulary (ids 0-2 double as unk/bos/eos)."""
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    for i, b in enumerate(range(32, 127)):
        vocab.pop(f"<{b}>")
        vocab[chr(b)] = b
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<1>", eos_token="<2>")


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    return save_tiny(tiny_config(kind), path, seed)


@torch.no_grad()
def randomize(module: torch.nn.Module, extra: tuple[tuple[str, float], ...] = ()) -> None:
    """save_tiny's rules on a module's parameters and buffers (from the global RNG)."""
    for name, p in module.named_parameters():
        rule = next((std for fragment, std in extra if fragment in name), None)
        if rule is not None:
            p.normal_(0.0, rule)
        elif "norm" in name:
            p.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.1)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.3)
    for name, b in module.named_buffers():  # buffers saved with the weights (a router's correction bias)
        rule = next((std for fragment, std in extra if fragment in name), None)
        if rule is not None:
            b.normal_(0.0, rule)


def save_tiny(config, path: Path, seed: int = 0, extra: tuple[tuple[str, float], ...] = ()) -> Path:
    """An HF model of `config`, randomized where HF's init would hide a mistake, saved with the byte tokenizer.
    HF initializes norms to 1 (or 0 for (1 + w) norms) and biases to 0: norms uniform in [0.5, 1.5], biases
    normal(0, 0.1); a decisive MoE router (mlp.gate.weight, normal(0, 0.3)). `extra`: (name fragment, std) rules
    tried first (a family's sinks, a larger router or q/k scale), and on buffers too (DeepSeek V3's router bias)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, extra)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
