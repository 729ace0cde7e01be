"""DeepSeek V4's multi-token-prediction (MTP) layer as a speculative draft (speculative_config method "deepseek_mtp"):
the checkpoint's `mtp.0.*` tensors, which transformers' DeepseekV4ForCausalLM ignores (it has no MTP module), laid
out as DeepSeek's reference code builds the layer: a whole V4 block (hyper-connections, attention, MoE) plus
    e_proj, h_proj, enorm, hnorm, norm, hc_head_fn / hc_head_base / hc_head_scale.

At position i it predicts the token after next from the target's last-layer streams S_i [hc_mult, hidden] (what the
target's head collapses: DeepseekV4ForCausalLM.forward hands them out flattened) and the token at i + 1:
    streams = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(S_i))    (the embedding's term added to every stream),
then the block, then logits = head(norm(hc_head(streams))) with the layer's own hc_head. For k > 1 the layer runs
again on its own draft and its own output streams in place of S, as MTPDraft runs V3's. Unlike V3's (and vLLM's
convention there) position 0's embedding is not zeroed: DeepSeek's V4 reference embeds every token as it is.

The layer's attention type: DeepSeek's configs list one compress ratio per layer, the MTP layers' after the
decoder's (`compress_ratios[num_hidden_layers]`, read from config.json; transformers keeps only the decoder's as
layer_types): 0 a sliding layer, else the layer type of that rate. A config without it (transformers'
save_pretrained writes layer_types only) gets a sliding layer. Its MLP is routed MoE: hash routing is for the first
layers only. Its caches are the draft's own, in the target's group of the same spec (DraftModel.bind_kv_cache).

The embedding and the LM head are the target's, shared (`share_target`); copies in the checkpoint
(`mtp.0.embed.weight`, `mtp.0.head.weight`) are compared with the target's and refused if they differ. Parallelism:
the block splits as the target's blocks do (heads, output groups, experts; EP from the target's config through the
draft's, DRAFT_PARALLEL_POLICY); e_proj, h_proj, the norms and hc_head are replicated, every rank holding every
stream.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import CausalLM, refuse
from surge.model.layers.linear import Linear
from surge.model.models.deepseek_mtp import TargetCopy
from surge.model.models.deepseek_v4 import (COMPRESSED_LAYER_TYPES, DeepseekV4ForCausalLM, DeepseekV4Layer,
                                            HyperHead, RMSNorm, make_rotaries)


def mtp_layer_type(tc, hf_config: dict) -> str:
    """The MTP layer's attention type: compress_ratios[num_hidden_layers] where config.json lists it, else sliding."""
    ratios = hf_config.get("compress_ratios") or []
    if len(ratios) <= tc.num_hidden_layers:
        return "sliding_attention"
    ratio = ratios[tc.num_hidden_layers]
    if ratio == 0:
        return "sliding_attention"
    by_rate = {tc.compress_rates.get(kind): kind for kind in COMPRESSED_LAYER_TYPES}
    if ratio not in by_rate:
        raise refuse(f"compress_ratios[{tc.num_hidden_layers}]", ratio,
                     f"0 or a rate of compress_rates {tc.compress_rates} (the MTP layer's)")
    return by_rate[ratio]


class DeepseekV4MTPLayer(DeepseekV4Layer):
    """A V4 block with the MTP layer's input projections and its own stream collapse."""

    def __init__(self, tc, layer_type: str, rotaries) -> None:
        super().__init__(tc, layer_type, "moe", rotaries)
        hidden, eps = tc.hidden_size, tc.rms_norm_eps
        # Replicated, like the hyper-connections they feed: every rank holds every stream whole.
        self.e_proj, self.h_proj = Linear(hidden, hidden), Linear(hidden, hidden)
        self.enorm, self.hnorm, self.norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.hc_head = HyperHead(tc.hc_mult, hidden, tc.hc_eps, eps)
        self.embed: nn.Module | None = TargetCopy()  # dropped once shared
        self.head: nn.Module = TargetCopy()  # the target's LM head once shared


class DeepseekV4MTP(DeepseekV4ForCausalLM):
    """The MTP layer alone (num_nextn_predict_layers = 1, as the V4 checkpoints ship it). It reuses the target's
    builders, checks and checkpoint names, not its decoder stack: CausalLM's constructor, not the target's."""

    def __init__(self, config, quant_config=None) -> None:
        CausalLM.__init__(self, config, quant_config)
        tc = self.tc
        self.check_config(tc)
        self.hc_mult = tc.hc_mult
        rotaries = make_rotaries(tc, config.max_model_len)
        self.rotary_main, self.rotary_compress = rotaries["main"], rotaries["compress"]
        self.mtp = nn.ModuleList([DeepseekV4MTPLayer(tc, mtp_layer_type(tc, config.hf_config), rotaries)])
        self.embed_tokens: nn.Module | None = None  # the target's, by share_target

    @property
    def layer(self) -> DeepseekV4MTPLayer:
        return self.mtp[0]

    def share_target(self, target: nn.Module) -> None:
        """After loading: the target's embedding and LM head become this model's (checkpoint copies compared)."""
        layer = self.layer
        layer.embed.check_equal(target.embed_tokens, "embed")
        layer.head.check_equal(target.lm_head, "head")
        layer.embed, layer.head = None, target.lm_head
        self.embed_tokens = target.embed_tokens

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Only the MTP layer's tensors (`mtp.0.*`, or under `model.`), named as the target's blocks are."""
        m = re.match(r"(?:model\.)?mtp\.(\d+)\.(.+)$", name)
        if m is None:
            return None
        if m[1] != "0":
            raise ValueError(f"checkpoint tensor {name!r}: only one MTP layer (mtp.0) is supported")
        rest = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", m[2])
        mapped = super().checkpoint_name_to_param(f"layers.0.{rest}")
        if mapped is None:
            return None
        return f"mtp.0.{mapped[0].removeprefix('layers.0.')}", mapped[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """previous_hidden [T, hc_mult * hidden]: the target's last-layer streams at the same positions (or, in a
        decode pass, this layer's output of the pass before). Returns this layer's streams, flattened alike."""
        layer = self.layer
        streams = previous_hidden.view(previous_hidden.shape[0], self.hc_mult, -1)
        x = layer.h_proj(layer.hnorm(streams)) + layer.e_proj(layer.enorm(self.embed_tokens(input_ids))).unsqueeze(1)
        return layer(positions, x, input_ids, meta).flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        layer = self.layer
        return layer.head(layer.norm(layer.hc_head(hidden.view(hidden.shape[0], self.hc_mult, -1))))
