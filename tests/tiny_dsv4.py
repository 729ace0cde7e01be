"""Tiny random DeepSeek V4 checkpoints (HF transformers' own DeepseekV4ForCausalLM, saved with save_pretrained) for
the model's parity tests.

Every layer type (sliding, CSA at rate 4 with an indexer keeping 3 entries, HCA at rate 8 so that a 40-token prompt
spans several of its windows), both MLP types (a hash_moe layer first, sqrtsoftplus-routed MoE with a correction
bias after), two hyper-connection streams, a sliding window of 6 (smaller than the prompts), partial rotary (8 of 32
channels), two output groups. "deepseek-v4-yarn": the compressed layers' rope scaled by yarn, as the released
configs do."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import DeepseekV4Config

from tiny_models import VOCAB, save_tiny

_LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
           "compressed_sparse_attention"]


def tiny_config(kind: str) -> DeepseekV4Config:
    rope = {}
    if kind == "deepseek-v4-yarn":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                "beta_slow": 1.0}
    elif kind != "deepseek-v4":
        raise ValueError(kind)
    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(_LAYERS),
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=_LAYERS, mlp_layer_types=["hash_moe"] + ["moe"] * (len(_LAYERS) - 1),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
        index_topk=3, partial_rotary_factor=0.25, max_position_embeddings=512, num_nextn_predict_layers=0,
        swiglu_limit=0.5, rope_parameters=rope or None, bos_token_id=1, eos_token_id=2)


# Randomized where HF's init hides a mistake: zero sinks, position biases and hyper-connection biases, unit scales,
# a zero correction bias, a tid2eid of zeros; projections large enough that attention and the indexer are decisive.
_EXTRA = (("attn.sinks", 1.0), ("position_bias", 0.5), ("_hc.base", 0.5), ("_hc.scale", 0.5),
          ("hc_head.hc_base", 0.5), ("hc_head.hc_scale", 0.5), ("e_score_correction_bias", 0.3),
          ("q_b_proj", 0.3), ("kv_proj", 0.3), ("q_a_proj", 0.3), ("weights_proj", 0.5))


@contextmanager
def hf_indexer_ties_to_lower_index() -> Iterator[None]:
    """HF's indexer with Surge's documented choice among exactly tied scores (the lower index): its scores less
    index * 1e-30, which only separates exact ties. The indexer's ReLU scores are often exactly 0, and torch.topk,
    which HF calls, leaves the order of ties unspecified."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

    scorer = hf_v4.DeepseekV4IndexerScorer.forward

    def forward(self, q, compressed_kv, hidden_states):
        scores = scorer(self, q, compressed_kv, hidden_states)
        return scores - torch.arange(scores.shape[-1], dtype=scores.dtype) * 1e-30

    hf_v4.DeepseekV4IndexerScorer.forward = forward
    try:
        yield
    finally:
        hf_v4.DeepseekV4IndexerScorer.forward = scorer


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    return make_tiny_model_of(tiny_config(kind), path, seed)


def make_tiny_model_of(config: DeepseekV4Config, path: Path, seed: int = 0) -> Path:
    import torch

    path = save_tiny(config, path, seed, extra=_EXTRA)
    # The hash layers' frozen token -> experts table: distinct experts per token, spread over the experts.
    from safetensors.torch import load_file, save_file
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("gate.tid2eid")]:
        vocab, k = tensors[name].shape
        tensors[name] = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:k] for _ in range(vocab)])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def make_tiny_v4_mtp_model(path: Path, mtp: str, seed: int = 0, copies: bool = False) -> Path:
    """A tiny V4 checkpoint with an MTP layer (num_nextn_predict_layers = 1; its tensors `mtp.0.*` in
    model-mtp.safetensors, named as DeepSeek's checkpoints name them; HF's model ignores them), of two kinds:
    - "random": the target of every layer type above, and an MTP layer of its own random weights whose attention is
      CSA (config.json's compress_ratios, one per layer and the MTP layer's last, as DeepSeek's configs list them):
      its token rows and entries share the target's CSA groups;
    - "copy": a one-layer target (sliding, routed MoE) and the MTP block a copy of that layer, e_proj the identity,
      h_proj zero (the target's streams ignored), unit enorm, norm and hc_head the target's, every embedding row
      scaled to RMS 1 (so enorm leaves it as the target's layer sees it, on every stream). Its KV at position j holds
      token j + 1's, so over the sliding window it sees what the target sees one position on: it computes the
      target's own next prediction, and its drafts are accepted.
    copies: also ship mtp.0.embed and mtp.0.head, equal to the target's."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if mtp == "copy":
        config = tiny_config("deepseek-v4")
        config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
    elif mtp == "random":
        config = tiny_config("deepseek-v4")
    else:
        raise ValueError(mtp)
    config.num_nextn_predict_layers = 1
    path = make_tiny_model_of(config, path, seed)
    hidden = config.hidden_size
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if mtp == "copy":
            emb = hf.model.embed_tokens.weight
            emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
            hf.save_pretrained(path)
            saved = load_file(str(path / "model.safetensors"))
            block = {n.removeprefix("model.layers.0."): t for n, t in saved.items() if n.startswith("model.layers.0.")}
            own = {"e_proj.weight": torch.eye(hidden), "h_proj.weight": torch.zeros(hidden, hidden),
                   "enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                   "norm.weight": hf.model.norm.weight.clone(), "hc_head_fn": hf.model.hc_head.hc_fn.clone(),
                   "hc_head_base": hf.model.hc_head.hc_base.clone(), "hc_head_scale": hf.model.hc_head.hc_scale.clone()}
        else:
            one = tiny_config("deepseek-v4")  # a CSA layer with routed MoE, randomized by the same rules
            one.num_hidden_layers, one.layer_types, one.mlp_layer_types = 1, ["compressed_sparse_attention"], ["moe"]
            donor = make_tiny_model_of(one, path.parent / f"{path.name}-mtp-donor", seed + 1)
            saved = load_file(str(donor / "model.safetensors"))
            block = {n.removeprefix("model.layers.0."): t for n, t in saved.items() if n.startswith("model.layers.0.")}
            own = {"e_proj.weight": torch.randn(hidden, hidden, generator=g) * hidden ** -0.5,
                   "h_proj.weight": torch.randn(hidden, hidden, generator=g) * hidden ** -0.5,
                   "enorm.weight": torch.rand(hidden, generator=g) + 0.5,
                   "hnorm.weight": torch.rand(hidden, generator=g) + 0.5,
                   "norm.weight": torch.rand(hidden, generator=g) + 0.5,
                   "hc_head_fn": torch.randn(config.hc_mult, config.hc_mult * hidden, generator=g) * 0.1,
                   "hc_head_base": torch.randn(config.hc_mult, generator=g) * 0.5,
                   "hc_head_scale": torch.randn(1, generator=g) * 0.5}
            settings = json.loads((path / "config.json").read_text())
            settings["compress_ratios"] = [0, 4, 8, 4, 4]  # the decoder's rates, then the MTP layer's
            (path / "config.json").write_text(json.dumps(settings))
        tensors = {**block, **own}
        if copies:
            tensors |= {"embed.weight": hf.model.embed_tokens.weight.clone(), "head.weight": hf.lm_head.weight.clone()}
    save_file({f"mtp.0.{n}": t.contiguous() for n, t in tensors.items()}, str(path / "model-mtp.safetensors"))
    return path


def mtp_block_checkpoint(path: Path) -> Path:
    """The HF checkpoint whose layer 0 is make_tiny_v4_mtp_model's MTP block: the donor ("random"), or the target
    itself ("copy")."""
    donor = path.parent / f"{path.name}-mtp-donor"
    return donor if donor.exists() else path
