"""Every environment variable Surge reads, typed and documented in one place.

Read lazily (module attribute access) so tests can set them with monkeypatch.
"""
from __future__ import annotations

import os
from pathlib import Path


def _cache_dir() -> Path:
    """SURGE_CACHE_DIR: where converted models (the default model) live. Default ~/.cache/surge."""
    return Path(os.environ.get("SURGE_CACHE_DIR", "~/.cache/surge")).expanduser()


def _log_level() -> str:
    """SURGE_LOG_LEVEL: logging level name for the `surge` logger. Default INFO."""
    return os.environ.get("SURGE_LOG_LEVEL", "INFO").upper()


def _api_key() -> str | None:
    """SURGE_API_KEY: the key `surge serve` requires when --api-key is not given. Default: none (open)."""
    return os.environ.get("SURGE_API_KEY") or None


def _rank_timeout() -> float:
    """SURGE_RANK_TIMEOUT: seconds the engine waits for its worker ranks to start, or to answer one step, before
    it gives up on them (a rank that dies is noticed at once; this catches hangs). Default 900."""
    return float(os.environ.get("SURGE_RANK_TIMEOUT", "900"))


def _weight_cache_dir() -> Path:
    """SURGE_WEIGHT_CACHE_DIR: where the Fast Start daemons' sockets live (--weight-cache-dir overrides it).
    Default /tmp/surge-weight-cache-UID, created 0700."""
    return Path(os.environ.get("SURGE_WEIGHT_CACHE_DIR") or f"/tmp/surge-weight-cache-{os.getuid()}").expanduser()


def _cpu_packed_weights() -> bool:
    """SURGE_CPU_PACKED_WEIGHTS: on the CPU, keep a copy of each linear weight in oneDNN's blocked layout for faster
    GEMMs (costs the weights' size again in memory). 0 turns it off. Default 1."""
    return os.environ.get("SURGE_CPU_PACKED_WEIGHTS", "1") not in ("0", "false", "False", "")


def _onednn_max_cpu_isa() -> str | None:
    """ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA): oneDNN's own cap on the instructions it uses (e.g. AVX2),
    read here only so the CPU GEMM's choice follows it (surge/model/layers/cpu_caps.py). Default: none."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None


def _moe_routing_simulation() -> str | None:
    """SURGE_MOE_ROUTING_SIMULATION: for benchmarks of random-weight MoE models only. "uniform_random" routes each
    token to k experts drawn uniformly (equal weights) instead of the router's choice, as vLLM's
    VLLM_MOE_ROUTING_SIMULATION_STRATEGY does, so both engines read the same share of expert weights. Default: off."""
    value = os.environ.get("SURGE_MOE_ROUTING_SIMULATION") or None
    if value not in (None, "uniform_random"):
        raise ValueError(f"SURGE_MOE_ROUTING_SIMULATION={value!r} is not supported; supported: uniform_random")
    return value


def _triton_key_cache() -> bool:
    """SURGE_TRITON_KEY_CACHE: reuse Triton's own version key (a hash of its compiler and its ~100 MB library,
    which every process otherwise recomputes before its first kernel: ~0.4 s of start-up) while those files keep
    their size and modification time; kept beside the compiled kernels. 0 turns it off. Default 1."""
    return os.environ.get("SURGE_TRITON_KEY_CACHE", "1") not in ("0", "false", "False", "")


def _allow_runtime_lora_updating() -> bool:
    """SURGE_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): `surge serve` answers
    /v1/load_lora_adapter and /v1/unload_lora_adapter, which read adapter directories on the server's disk. 1 or
    true turns them on. Default: off (both answer 404)."""
    value = os.environ.get("SURGE_ALLOW_RUNTIME_LORA_UPDATING") or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return (value or "").strip().lower() in ("1", "true")


def _fp8_gemv() -> str:
    """SURGE_FP8_GEMV: which decode fp8 GEMV (surge/kernels/gemv.py) serves 1-4 rows: "stream" (the pipelined
    weight stream, one reduction at the end) or "tiles" (the earlier per-step reduction), to compare both on the GPU
    in one build. Default stream."""
    value = os.environ.get("SURGE_FP8_GEMV", "stream")
    if value not in ("stream", "tiles"):
        raise ValueError(f"SURGE_FP8_GEMV={value!r} is not supported; supported: stream, tiles")
    return value


_GETTERS = {
    "SURGE_ALLOW_RUNTIME_LORA_UPDATING": _allow_runtime_lora_updating,
    "SURGE_API_KEY": _api_key,
    "SURGE_CACHE_DIR": _cache_dir,
    "ONEDNN_MAX_CPU_ISA": _onednn_max_cpu_isa,
    "SURGE_CPU_PACKED_WEIGHTS": _cpu_packed_weights,
    "SURGE_FP8_GEMV": _fp8_gemv,
    "SURGE_MOE_ROUTING_SIMULATION": _moe_routing_simulation,
    "SURGE_LOG_LEVEL": _log_level,
    "SURGE_RANK_TIMEOUT": _rank_timeout,
    "SURGE_TRITON_KEY_CACHE": _triton_key_cache,
    "SURGE_WEIGHT_CACHE_DIR": _weight_cache_dir,
}


def __getattr__(name: str):
    if name in _GETTERS:
        return _GETTERS[name]()
    raise AttributeError(f"surge.envs has no variable {name!r}; known: {sorted(_GETTERS)}")


def __dir__() -> list[str]:
    return sorted(_GETTERS)
