"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) and Qwen2-VL (Qwen2VLForConditionalGeneration): a ViT that takes each image as a sequence of patches (window
attention, with full attention at `fullatt_block_indexes`; 2-D rotary over patch rows and columns; 2x2 patches
merged into one token), and a Qwen2 decoder with M-RoPE: three positions per token (temporal, height, width).
Qwen2-VL's tower differs only in its norms (LayerNorm), MLP (fc1/fc2) and attention (whole image in every block).

Positions (HF's get_rope_index): text tokens count up as usual, all three axes equal; an image's tokens take
start + (t, row, column) of their merged patch, and the text after it continues from the image's largest position
+ 1. So a prompt's positions are its own table [3, P] (`mrope_positions`, computed once per request by the runner),
and every later token sits at its sequence position + `delta` (the table's max + 1 - P), on all three axes.

The tower is plain torch, replicated on every rank and run eagerly on each step's new images, all of them as one
packed sequence (`embed_images`); attention runs per window (or per image), windows of one length batched.
The front end uses the checkpoint's image processor and tokenizer (`load_processor`): transformers' full
Qwen2_5_VLProcessor also needs torchvision for its video half, which Surge does not take.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from surge.attention.backend import AttentionMetadata, Prologue
from surge.kernels.reference import rotate_half
from surge.model.arch import head_dim
from surge.model.layers.norm import LayerNorm, RMSNorm
from surge.model.layers.rotary import MRotaryEmbedding, RopeRows, rope_parameters
from surge.model.models.llama import DecoderAttention, Qwen2ForCausalLM
from surge.model.models.vision_language import TiedAsTheVLMSays, VisionLanguageModel
from surge.multimodal import MultiModalFeature

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a prompt, before expansion


# ---- the vision tower ----

class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[torch.Tensor]
                ) -> torch.Tensor:
        """segments: index tensors [n, L], each row one attention segment (a window or an image) of L tokens."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:  # [n, L, H, D] -> [n, H, L, D]: no mask, every segment full
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))
            out[rows.flatten()] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).flatten(0, 1)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        from transformers.activations import ACT2FN
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, activation (quick_gelu), fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        from transformers.activations import ACT2FN
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vc, qwen2: bool) -> None:
        super().__init__()
        dim = vc.embed_dim if qwen2 else vc.hidden_size
        norm = LayerNorm if qwen2 else RMSNorm
        self.norm1, self.norm2 = norm(dim, 1e-6), norm(dim, 1e-6)
        self.attn = VisionAttention(dim, vc.num_heads)
        self.mlp = (Qwen2VisionMLP(dim, int(dim * vc.mlp_ratio), vc.hidden_act) if qwen2
                    else VisionMLP(dim, vc.intermediate_size, vc.hidden_act))

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge_size x merge_size block of patches (consecutive rows of the sequence) into one LM token."""

    def __init__(self, out_dim: int, dim: int, merge_size: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.hidden = dim * merge_size ** 2
        self.ln_q = norm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


@dataclass
class _Layout:
    """Where each patch goes in one packed forward: the window order (in merge units), rotary positions (row,
    column) in that order, and the attention segments of the window and the full-attention blocks."""
    window_order: torch.Tensor  # [units]: merge unit at each place of the windowed sequence
    positions: torch.Tensor  # [patches, 2] in the windowed order
    windows: list[torch.Tensor]
    images: list[torch.Tensor]


def _segments(lengths: list[int]) -> list[torch.Tensor]:
    """Consecutive segments of these lengths as index tensors [n, L], one per distinct length."""
    starts = np.cumsum([0] + lengths[:-1])
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts.tolist(), lengths):
        if length:
            by_length.setdefault(length, []).append(start)
    return [torch.tensor(s)[:, None] + torch.arange(n) for n, s in by_length.items()]


class VisionTower(nn.Module):
    """Qwen2.5-VL's tower, or with qwen2 Qwen2-VL's: LayerNorms, an fc1/fc2 MLP, full attention in every block
    (`embed_dim` wide, `hidden_size` out)."""

    def __init__(self, vc, qwen2: bool = False) -> None:
        super().__init__()
        dim = vc.embed_dim if qwen2 else vc.hidden_size
        self.out_dim = vc.hidden_size if qwen2 else vc.out_hidden_size
        self.merge, self.patch = vc.spatial_merge_size, vc.patch_size
        self.window = None if qwen2 else vc.window_size
        self.full_blocks = set(range(vc.depth)) if qwen2 else set(vc.fullatt_block_indexes)
        self.head_dim = dim // vc.num_heads
        self.theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(vc.in_channels, dim, bias=False,
                                          kernel_size=(vc.temporal_patch_size, vc.patch_size, vc.patch_size))
        self.blocks = nn.ModuleList(VisionBlock(vc, qwen2) for _ in range(vc.depth))
        self.merger = PatchMerger(self.out_dim, dim, vc.spatial_merge_size, LayerNorm if qwen2 else RMSNorm)

    def layout(self, grids: list[list[int]]) -> _Layout:
        """HF's window index: each frame's merged grid cut into windows of window_size pixels (edge windows
        smaller), visited window by window; rotary positions are patch (row, column), merge blocks contiguous."""
        m, unit = self.merge, self.merge ** 2
        per_window = self.window // m // self.patch if self.window else 1 << 30  # no windows: one per frame
        order, positions, window_lengths, image_lengths = [], [], [], []
        base = 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            rows = np.arange(h).reshape(gh, m, 1, 1).repeat(m, 3).repeat(gw, 2)  # [gh, m, gw, m]
            cols = np.arange(w).reshape(1, 1, gw, m).repeat(m, 1).repeat(gh, 0)
            block_major = np.stack([rows.transpose(0, 2, 1, 3).reshape(-1), cols.transpose(0, 2, 1, 3).reshape(-1)],
                                   1).reshape(gh * gw, unit, 2)
            for frame in range(t):
                for wy in range(0, gh, per_window):
                    for wx in range(0, gw, per_window):
                        units = (np.arange(wy, min(wy + per_window, gh))[:, None] * gw
                                 + np.arange(wx, min(wx + per_window, gw))).reshape(-1)
                        order.append(units + base + frame * gh * gw)
                        positions.append(block_major[units].reshape(-1, 2))
                        window_lengths.append(units.size * unit)
                image_lengths.append(h * w)
            base += t * gh * gw
        return _Layout(torch.from_numpy(np.concatenate(order)), torch.from_numpy(np.concatenate(positions)),
                       _segments(window_lengths), _segments(image_lengths))

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """pixels [patches, C * T * P * P] of the images in order, grids their (t, h, w): -> [patches / merge^2,
        out_hidden], each image's tokens in its prompt order."""
        device, unit = pixels.device, self.merge ** 2
        lay = self.layout(grids)
        proj = self.patch_embed.proj
        x = F.linear(pixels.to(proj.weight.dtype), proj.weight.view(proj.weight.shape[0], -1))  # the conv, as a GEMM
        order = lay.window_order.to(device)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        dim = self.head_dim // 2  # each of row and column turns a quarter of the head's channels
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        freqs = (lay.positions.float()[..., None] * inv_freq).flatten(1).to(device)  # [patches, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        windows = [s.to(device) for s in lay.windows]
        images = [s.to(device) for s in lay.images]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in self.full_blocks else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)]


# ---- the language model: Qwen2 with M-RoPE ----

class MRopeAttention(DecoderAttention):
    def prologue(self, rows: RopeRows) -> Prologue:
        return Prologue(rows.index, rows.cos, rows.sin)


class Qwen2VLTextModel(TiedAsTheVLMSays, Qwen2ForCausalLM):
    """The decoder; `forward` takes positions [3, T] and turns them into the step's rotary rows once."""

    def make_rotary(self, layer_type: str) -> MRotaryEmbedding:
        params = rope_parameters(self.tc, layer_type)
        params.setdefault("mrope_section", [16, 24, 24])  # HF's default
        return MRotaryEmbedding(head_dim(self.tc), self.config.max_model_len, params)

    def make_attention(self, layer_index: int, sliding_window: int | None, rotary) -> nn.Module:
        return MRopeAttention(self.tc, sliding_window, rotary, qkv_bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: list[AttentionMetadata],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.layers[0].self_attn.rotary.rows(positions)  # every layer's rope is the same
        return super().forward(input_ids, rows, meta, inputs_embeds)


# ---- the model ----

class Qwen2VLProcessor:
    """What the front end needs of the checkpoint: its image processor (resize, normalize, patchify) and tokenizer."""

    def __init__(self, image_processor, tokenizer) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token = "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    uses_mrope = True  # the runner feeds positions [3, T] (temporal, height, width; StepInputs.model_positions)
    qwen2_tower = False

    def __init__(self, config, quant_config=None) -> None:
        from transformers import AutoConfig
        super().__init__(config, quant_config)
        hf = config.hf_config
        full = AutoConfig.for_model(hf.get("model_type", "qwen2_5_vl"),
                                    **{k: v for k, v in hf.items() if k != "model_type"})
        vc = full.vision_config
        self.merge = vc.spatial_merge_size
        self.visual = VisionTower(vc, self.qwen2_tower)
        if self.visual.out_dim != self.tc.hidden_size:
            raise ValueError(f"the vision tower's output size {self.visual.out_dim} (vision_config."
                             f"{'hidden_size' if self.qwen2_tower else 'out_hidden_size'}) must equal the language "
                             f"model's hidden_size={self.tc.hidden_size}")
        self.language_model = Qwen2VLTextModel(config, quant_config)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings

    # ---- the front end's part ----
    @classmethod
    def load_processor(cls, model_dir: str) -> Qwen2VLProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer
        return Qwen2VLProcessor(AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))

    @classmethod
    def image_placeholder(cls, processor) -> str:
        return IMAGE_PLACEHOLDER

    @classmethod
    def process_prompt(cls, processor: Qwen2VLProcessor, text: str, images: list, add_special_tokens: bool = True
                       ) -> tuple[list[int], list[MultiModalFeature]]:
        """Each `<|image_pad|>` expanded to the image's merged patch count (as HF's processor does), then tokenized;
        one feature per image: its patches and (t, h, w) grid."""
        pad = processor.image_token
        if text.count(pad) != len(images):
            raise ValueError(f"the prompt has {text.count(pad)} image placeholder(s) ({pad!r}, written "
                             f"{IMAGE_PLACEHOLDER!r}) for {len(images)} image(s) in multi_modal_data; put one where "
                             "each image goes")
        if not images:
            return processor.tokenizer.encode(text, add_special_tokens=add_special_tokens), []
        out = processor.image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"].tolist()
        merge = processor.image_processor.merge_size
        counts = [t * h * w // merge ** 2 for t, h, w in grids]
        parts = text.split(pad)
        expanded = parts[0] + "".join("\0" * n + rest for n, rest in zip(counts, parts[1:]))
        ids = processor.tokenizer.encode(expanded.replace("\0", pad), add_special_tokens=add_special_tokens)
        runs = [i for i, t in enumerate(ids) if t == processor.image_token_id]
        if len(runs) != sum(counts):
            raise ValueError(f"the prompt holds {len(runs)} {pad!r} tokens after expansion, not {sum(counts)}: "
                             f"{pad!r} may appear in the text only where an image goes")
        features, first, patch = [], 0, 0
        for grid, n in zip(grids, counts):
            offset = runs[first]
            assert runs[first + n - 1] == offset + n - 1, "an image's placeholders are a run"
            patches = grid[0] * grid[1] * grid[2]
            features.append(MultiModalFeature.of(out["pixel_values"][patch:patch + patches].float(), offset, n,
                                                 grid))
            first, patch = first + n, patch + patches
        return ids, features

    def mrope_positions(self, prompt_token_ids: list[int], features: list[MultiModalFeature]
                        ) -> tuple[np.ndarray | None, int]:
        """The prompt's M-RoPE positions [3, P] and the delta of every later token (None, 0 without images)."""
        if not features:
            return None, 0
        table = np.empty((3, len(prompt_token_ids)), dtype=np.int64)
        pos = text_start = 0
        for f in sorted(features, key=lambda f: f.offset):
            n_text = f.offset - text_start
            table[:, text_start:f.offset] = pos + np.arange(n_text)
            pos += n_text
            t, h, w = f.grid_thw[0], f.grid_thw[1] // self.merge, f.grid_thw[2] // self.merge
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            table[:, f.offset:f.end] = pos + grid
            pos += max(h, w)
            text_start = f.end
        table[:, text_start:] = pos + np.arange(len(prompt_token_ids) - text_start)
        return table, int(table.max()) + 1 - len(prompt_token_ids)

    # ---- the runner's part ----
    def embed_images(self, features: list[MultiModalFeature], device: torch.device) -> list[torch.Tensor]:
        """All the images in one tower forward: [tokens of each image, hidden]."""
        pixels = torch.cat([f.pixel_values(device) for f in features])
        merged = self.visual(pixels, [f.grid_thw for f in features])
        return list(merged.split([f.length for f in features]))

    def checkpoint_name_to_param(self, name: str):
        """transformers 5 (`model.visual.*`, `model.language_model.*`, `lm_head.*`) and the released checkpoints
        (`visual.*`, `model.*` for the decoder, `lm_head.*`)."""
        name = re.sub(r"^model\.(?=visual\.|language_model\.)", "", name)
        if name.startswith("visual."):
            return name, None
        if name.startswith("language_model."):
            name = "model." + name[len("language_model."):]
        mapped = self.language_model.checkpoint_name_to_param(name)
        return None if mapped is None else ("language_model." + mapped[0], mapped[1])


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: the same decoder, M-RoPE and prompt layout; its tower attends to the whole image in every block."""
    qwen2_tower = True
