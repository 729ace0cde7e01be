"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative draft (speculative_config method
"deepseek_mtp"): the checkpoint's layer model.layers.<num_hidden_layers> (DeepSeek-V3's layer 61).

At position i it predicts the token after next from the target's final hidden state h_i (after the final norm: what
the target's LM head reads) and the embedding of the token at i + 1:
    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]), then one DeepSeek decoder block (MLA over its own latent KV
    cache, and experts or a dense MLP as the target's layer of the same index would have), then
    logits = lm_head(shared_head.norm(x + residual)).
The embedding at position 0 is zeroed, as vLLM does. For k > 1 the layer runs again on its own draft and its own
output (before shared_head.norm) in place of h: DeepSeek trained one layer per depth, but V3/R1 ship one, which vLLM
runs recurrently too.

The embedding and the LM head are the target's modules, shared rather than copied (`share_target`). DeepSeek-V3's
checkpoint also ships them inside the MTP layer (embed_tokens, shared_head.head), equal to the target's: such
copies are compared with the target's at load and refused if they differ.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from surge.attention.backend import AttentionMetadata
from surge.model.arch import CausalLM, cfg_get, require
from surge.model.layers.linear import Linear
from surge.model.layers.norm import RMSNorm
from surge.model.models.deepseek_v2 import DeepseekV3ForCausalLM
from surge.model.models.llama import DecoderLayer
from surge.model.models.qwen3_moe import expert_param

# The MTP layer's own tensors; every other tensor of the layer belongs to its decoder block.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class TargetCopy(nn.Module):
    """Where the checkpoint's copy of a target weight lands: held (as read) until `share_target` compares it with the
    target's, never a parameter of the draft. A buffer with a weight loader, which the loader fills if present."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.weight.weight_loader = self.record
        self.loaded: torch.Tensor | None = None

    def record(self, buffer: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        self.loaded = loaded

    def check_equal(self, target: nn.Module, what: str) -> None:
        """target: a VocabParallelEmbedding (or LM head): the copy, sharded as the target is, must equal it."""
        if self.loaded is None:
            return
        mine = torch.empty_like(target.weight)
        target.weight_loader(mine, self.loaded)
        if not torch.equal(mine, target.weight):
            raise ValueError(f"the checkpoint's MTP layer has its own {what}, which differs from the target's; the "
                             "deepseek_mtp draft shares the target's (an MTP layer with its own is not supported)")
        self.loaded = None


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head: nn.Module = TargetCopy()  # the target's LM head once shared


class MTPLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, block: DecoderLayer) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False, quantizable=False)  # replicated; bf16 in V3's FP8
        self.shared_head = SharedHead(hidden, eps)
        self.embed_tokens: nn.Module | None = TargetCopy()  # dropped once shared (the model's embed_tokens)
        self.mtp_block = block


class DeepseekMTP(DeepseekV3ForCausalLM):
    """The MTP layer alone. It reuses DeepseekV3ForCausalLM's builders (rotary, MLA, routing, dense or sparse MLP by
    layer index) but not its decoder stack: CausalLM's constructor, not the target's."""

    def __init__(self, config, quant_config=None) -> None:
        CausalLM.__init__(self, config, quant_config)
        tc = self.tc
        require(tc, "hidden_act", ("silu",))
        self.check_routing(tc)
        self.mtp_index = tc.num_hidden_layers
        eps = cfg_get(tc, "rms_norm_eps", 1e-6)
        block = DecoderLayer(tc.hidden_size, eps, self.make_attention(self.mtp_index, None,
                                                                      self.make_rotary("full_attention")),
                             self.make_mlp(self.mtp_index))
        self.layers = nn.ModuleDict({str(self.mtp_index): MTPLayer(tc.hidden_size, eps, block)})
        self.embed_tokens: nn.Module | None = None  # the target's, by share_target

    @property
    def layer(self) -> MTPLayer:
        return self.layers[str(self.mtp_index)]

    def share_target(self, target: nn.Module) -> None:
        """After loading: the target's embedding and LM head become this model's (checkpoint copies compared)."""
        layer = self.layer
        layer.embed_tokens.check_equal(target.embed_tokens, "embed_tokens")
        layer.shared_head.head.check_equal(target.lm_head, "shared_head.head")
        layer.embed_tokens = None
        layer.shared_head.head = target.lm_head
        self.embed_tokens = target.embed_tokens

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Only the MTP layer's tensors, its decoder block's under mtp_block; the target's are skipped."""
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if m is None or int(m[1]) != self.mtp_index or "rotary_emb.inv_freq" in name:
            return None
        rest = m[2] if m[2].startswith(_OWN) else f"mtp_block.{m[2]}"
        name = f"layers.{m[1]}.{rest}"
        return expert_param(name) or self.weight_mapper.map(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """previous_hidden [T, hidden]: the target's final hidden states at the same positions (or, in a decode
        pass, this layer's output of the pass before). Returns the layer's hidden states, before shared_head.norm."""
        layer = self.layer
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = layer.eh_proj(torch.cat((layer.enorm(embeds), layer.hnorm(previous_hidden)), dim=-1))
        x, residual = layer.mtp_block(positions, x, None, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        layer = self.layer
        return layer.shared_head.head(layer.shared_head.norm(hidden))
