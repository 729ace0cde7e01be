"""The WeightCacheKey of one rank, computed by this one function on both sides (daemon and engine) before any
weight is loaded, and the name of each device's socket: by GPU UUID on CUDA, by global rank on CPU.
"""
from __future__ import annotations

import hashlib
import json
import platform
import re
import struct
from pathlib import Path

import torch

from surge.config import ModelConfig, ParallelConfig
from surge.version import __version__
from surge.weight_cache.protocol import PROTOCOL_VERSION, WeightCacheKey

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _safetensors_header(file: Path) -> bytes:
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: not a safetensors file (header length {size} bytes)")
        header = f.read(size)
        if len(header) != size:
            raise ValueError(f"{file}: truncated safetensors header")
        return header


def checkpoint_identity(model_dir: str | Path) -> str:
    """sha256 of every shard's name, size, modification time and safetensors header (names, dtypes, shapes,
    offsets), never the weight bytes. Headers alone cannot tell two fine-tunes of one architecture apart; the
    size and mtime make a rewritten checkpoint a new key (at worst an engine loads from disk once more)."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(model_dir)!r}: no *.safetensors weight files found")
    for file in files:
        st = file.stat()
        header = _safetensors_header(file)
        h.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\0{len(header)}\0".encode())
        h.update(header)
    return h.hexdigest()


def model_config_identity(mc: ModelConfig) -> str:
    blob = json.dumps({"hf_config": mc.hf_config, "layer_types": mc.layer_types, "sliding_window": mc.sliding_window},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_identity(device: torch.device) -> tuple[str, str, str]:
    """(kind, uuid, arch). On CUDA the UUID, not the index: the same GPU has another index under another
    CUDA_VISIBLE_DEVICES."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(cuda_index(device))
        return "cuda", str(props.uuid), f"sm_{props.major}{props.minor}"
    if device.type == "cpu":
        return "cpu", "cpu", platform.machine()
    raise ValueError(f"device={device} is not supported by the weight cache; supported: cpu, cuda")


def weight_cache_key(mc: ModelConfig, pc: ParallelConfig, rank: int, device: torch.device) -> WeightCacheKey:
    kind, uuid, arch = device_identity(device)
    quant = (mc.hf_config.get("quantization_config") or {}).get("quant_method", "none")
    return WeightCacheKey(
        protocol_version=PROTOCOL_VERSION, surge_version=__version__, torch_version=str(torch.__version__),
        checkpoint=checkpoint_identity(mc.model), model_config=model_config_identity(mc),
        architecture=mc.architecture, dtype=str(mc.dtype).removeprefix("torch."), quantization=str(quant),
        max_model_len=mc.max_model_len, tensor_parallel_size=pc.tensor_parallel_size, tensor_parallel_rank=rank,
        expert_parallel_size=pc.expert_parallel_size,
        pipeline_parallel_size=1, pipeline_parallel_rank=0, device_kind=kind, device_uuid=uuid, device_arch=arch)


def socket_name(device: torch.device, rank: int) -> str:
    """One socket per device: `gpu-UUID.sock` on CUDA (a GPU holds one rank's shard), `rank-N.sock` on CPU."""
    if device.type == "cuda":
        _, uuid, _ = device_identity(device)
        return f"gpu-{re.sub(r'[^A-Za-z0-9-]', '', uuid)}.sock"
    return f"rank-{rank}.sock"
