"""Convert a llama.cpp GGUF checkpoint into a Hugging Face Llama directory.

Dequantizes every tensor, restores HF tensor names and rotary row order, and writes model.safetensors,
config.json, generation_config.json and the tokenizer (chat template included), atomically.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("llama",)

# Written last into every converted directory; a reader trusts a directory only when it finds this.
CONVERSION_MARKER = "surge_conversion.json"
# Bump when the converter's output changes, so cached conversions are redone.
CONVERTER_VERSION = 1

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama parameter name of a llama.cpp tensor name."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}.weight"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Llama counterpart; supported: {sorted(_GLOBAL_TENSOR_NAMES)} "
        f"and blk.N.{{{','.join(_BLOCK_TENSOR_NAMES)}}}.weight"
    )


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) while HF rotates halves (x[i], x[i + d/2]), so its converter
    interleaves each head's two halves. This puts them back: per head, rows (i, 2) -> (2, i).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_metadata(reader) -> dict[str, object]:
    """All scalar and string GGUF metadata fields (large token arrays left out) as Python values."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue
        metadata[key] = field.contents()
    return metadata


def _float32_value(value: float) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. Keep the number the checkpoint meant.
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def llama_config(metadata: dict[str, object], tied_embeddings: bool, dtype: torch.dtype) -> dict[str, object]:
    """config.json contents of an HF LlamaForCausalLM from llama.cpp metadata."""
    def field(name: str, default=None):
        value = metadata.get(f"llama.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{name}, which a Llama config needs")
        return value

    rope_scaling = metadata.get("llama.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {rope_scaling!r} is not supported; only unscaled rotary (none) is")
    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"GGUF rope.dimension_count={rotary_dim} differs from head_dim={head_dim}; partial rotary is not supported"
        )
    rope_theta = _float32_value(field("rope.freq_base", 10000.0))
    vocab_size = field("vocab_size")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(field("context_length")),
        "rms_norm_eps": _float32_value(field("attention.layer_norm_rms_epsilon")),
        # Both spellings: transformers 5 reads rope_parameters, older readers and other engines rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": str(dtype).removeprefix("torch."),
    }


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> Path:
    """Convert a llama-architecture GGUF file into an HF model directory at out_dir (which must not exist).

    The directory appears whole or not at all: everything is written into a temporary sibling, then renamed.
    """
    import gguf
    from gguf.quants import dequantize

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"out_dir {str(out_dir)!r} already exists; remove it or pick another directory")
    reader = gguf.GGUFReader(gguf_path)
    metadata = read_metadata(reader)
    if "llama.vocab_size" not in metadata and "tokenizer.ggml.tokens" in reader.fields:
        # Older llama.cpp files leave the vocabulary size implicit in the token list.
        metadata["llama.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF {gguf_path.name} has architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    tensor_names = {tensor.name for tensor in reader.tensors}
    config = llama_config(metadata, tied_embeddings="output.weight" not in tensor_names, dtype=dtype)
    rotary_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    state_dict = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        if not weights.flags.writeable:  # unquantized tensors come back as read-only views of the mmap
            weights = weights.copy()
        weight = torch.from_numpy(weights).to(dtype)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if kind in rotary_heads:
            weight = unpermute_rotary_rows(weight, rotary_heads[kind])
        state_dict[hf_tensor_name(tensor.name)] = weight.contiguous()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        from safetensors.torch import save_file

        save_file(state_dict, tmp_dir / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp_dir / "config.json", config)
        generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        _write_json(tmp_dir / "generation_config.json", generation_config)
        _save_tokenizer(gguf_path, tmp_dir, model_max_length=config["max_position_embeddings"])
        _write_json(tmp_dir / CONVERSION_MARKER, {
            "converter_version": CONVERTER_VERSION,
            "source": gguf_path.name,
            "source_size": gguf_path.stat().st_size,
            "dtype": config["dtype"],
        })
        # mkdtemp (and safetensors) create owner-only entries; a model cache is meant to be shared like any download.
        for path in tmp_dir.iterdir():
            path.chmod(0o644)
        tmp_dir.chmod(0o755)
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _save_tokenizer(gguf_path: Path, out_dir: Path, model_max_length: int) -> None:
    # transformers rebuilds a fast tokenizer (and the chat template) from the GGUF vocabulary and merges.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
