"""Frozen engine configuration: model, cache, scheduler, parallel; validated with errors that name the field.

Building them does no I/O: surge/engine/args.py (EngineArgs) reads the model's files and turns user-facing
arguments into these.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU, bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; choose one of auto, {', '.join(_DTYPES)}")
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    model: str  # an HF-format directory
    hf_config: dict = field(repr=False, hash=False, compare=False)  # config.json as written
    dtype: torch.dtype
    architecture: str
    max_model_len: int
    # Per-layer attention kind as the config says it: "full_attention" or "sliding_attention" (a model may decide
    # otherwise for its own layers: the runner reads each attention layer's parameters).
    layer_types: tuple[str, ...]
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # A key of the loader table (surge/model/loader/base.py). "safetensors": the checkpoint; "dummy": random weights
    # (presets, benchmarks); "weight_cache": mapped from this rank's Fast Start daemon (surge/weight_cache),
    # falling back to the checkpoint as WeightCacheConfig says.
    load_format: str = "safetensors"
    # The language model's config normalized by transformers (AutoConfig: derived layer_types, standard
    # rope_parameters, defaults filled in; a VLM's text_config): what models read. Built from hf_config when omitted.
    text_config: Any = field(default=None, repr=False, hash=False, compare=False)
    # --quantization: online quantization of an unquantized checkpoint ("fp8"), or the checkpoint's own
    # quantization_config.quant_method named again (surge/model/quant).
    quantization: str | None = None
    # "generate" (sampling) or "pooling" (prefill only: embeddings, classification, scores); see RUNNERS.
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None  # the pooling runner's: the checkpoint's, overridden by the user's
    # A classifier read off the LM head (a decoder reranker): the token ids of classifier_from_token, resolved by
    # the tokenizer (Qwen3-Reranker: [no, yes], scored as the yes logit minus the no logit).
    classifier_token_ids: tuple[int, ...] = ()
    # A multimodal model's most items per prompt, by modality ({"image": 4}); a modality absent: the default.
    limit_mm_per_prompt: dict = field(default_factory=dict, hash=False, compare=False)
    # Where images may come from besides data: URLs (surge/multimodal/media.py): file:// URLs and paths under this
    # directory, and http(s) URLs of these hosts. Both off by default.
    allowed_local_media_path: str | None = field(default=None, compare=False)
    allowed_media_domains: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.text_config is None:
            object.__setattr__(self, "text_config", normalize_hf_config(self.model, self.hf_config))
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} is not supported; choose one of {', '.join(RUNNERS)}")
        if (self.runner == "pooling") != (self.pooler_config is not None):
            raise ValueError(f"runner={self.runner!r}: a pooler_config goes with the pooling runner, and only there")
        if self.runner == "generate" and not self.architecture.endswith(GENERATIVE_SUFFIXES):
            raise ValueError(f"model={self.model!r}: {self.architecture} has no LM head to generate with; serve it "
                             "with runner='pooling' (--runner pooling)")

    # ---- pooling ----
    @property
    def is_cross_encoder(self) -> bool:
        """A sequence-classification head: classify and score (query and document together), never embed."""
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def num_labels(self) -> int:
        if self.classifier_token_ids:
            two_way = (self.hf_config.get("is_original_qwen3_reranker")
                       or self.hf_config.get("method") == "from_2_way_softmax")
            return 1 if two_way and len(self.classifier_token_ids) == 2 else len(self.classifier_token_ids)
        return int(getattr(self.text_config, "num_labels", 1))

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        if self.runner != "pooling":
            return ()
        return ("classify", "score", "encode") if self.is_cross_encoder else ("embed", "score", "encode")

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return self.hf_config.get("matryoshka_dimensions") or None

    @property
    def is_matryoshka(self) -> bool:
        """The model declares that a prefix of its embedding is an embedding too (Matryoshka training)."""
        return bool(self.matryoshka_dimensions) or bool(self.hf_config.get("is_matryoshka"))

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        tc = self.text_config
        return getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads

    @property
    def head_dim(self) -> int:
        tc = self.text_config
        return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def num_experts(self) -> int:
        """Routed experts per mixture-of-experts layer; 0 for a dense model. HF configs name it either way."""
        tc = self.text_config
        return getattr(tc, "num_experts", None) or getattr(tc, "num_local_experts", None) or 0

    @property
    def quantization_config(self) -> dict | None:
        return self.hf_config.get("quantization_config")

    @staticmethod
    def from_hf_config(model: str, cfg: dict, gen_cfg: dict, dtype: str | torch.dtype, device: torch.device,
                       max_model_len: int | None = None, load_format: str = "safetensors", *,
                       supported_architectures: Collection[str], runner: str = "auto",
                       pooler_config: PoolerConfig | None = None,
                       classifier_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """From config.json and generation_config.json as dicts; supported_architectures: the model registry's
        names (surge/model/models/registry.py), passed in because configs sit below the models. runner "auto":
        pooling for an architecture without an LM head (an encoder, a classifier), else generate."""
        archs = cfg.get("architectures") or []
        supported = [a for a in archs if a in supported_architectures]
        if not supported:
            raise ValueError(f"model={model!r}: architecture {archs or '(none given)'} is not supported; "
                             f"supported: {', '.join(supported_architectures)}")
        hf = _transformers_text_config(model, cfg)
        tc = TextConfig.of(hf)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            value = getattr(tc, key, None)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model={model!r}: config.json field {key!r} must be a positive integer, "
                                 f"got {value!r}")
        layer_types, sliding_window = _layer_types(model, hf)
        model_max = getattr(tc, "max_position_embeddings", None) or 4096
        if max_model_len is None:
            max_model_len = model_max
        elif not (isinstance(max_model_len, int) and 1 <= max_model_len):
            raise ValueError(f"max_model_len={max_model_len!r} must be a positive integer")
        if runner == "auto":
            runner = "generate" if supported[0].endswith(GENERATIVE_SUFFIXES) else "pooling"
        if runner == "pooling":
            pooler_config = pooler_config or PoolerConfig()
        return ModelConfig(model=model, hf_config=cfg, dtype=resolve_dtype(dtype, device),
                           architecture=supported[0], max_model_len=max_model_len,
                           layer_types=layer_types, sliding_window=sliding_window,
                           eos_token_ids=_eos_token_ids(gen_cfg, cfg), load_format=load_format, text_config=tc,
                           runner=runner, pooler_config=pooler_config if runner == "pooling" else None,
                           classifier_token_ids=classifier_token_ids)


def normalize_hf_config(model: str, cfg: dict) -> TextConfig:
    """config.json through transformers' own config class (no I/O): the language model's part of it, as plain
    attributes."""
    return TextConfig.of(_transformers_text_config(model, cfg))


class TextConfig(types.SimpleNamespace):
    """transformers' normalized text config as plain attributes: every public value it exposes (defaults filled in,
    aliases such as num_experts / num_local_experts and derived properties included), so that models read it as they
    would read transformers' object, while the engine core process, which unpickles it, never imports transformers
    (~1.2 s of start-up)."""

    @staticmethod
    def of(hf: Any) -> TextConfig:
        values = {}
        for name in dir(hf):
            if name.startswith("_"):
                continue
            try:
                value = getattr(hf, name)
            except Exception:  # a property that does not apply to this config
                continue
            if not callable(value) and _plain(value):
                values[name] = value
        return TextConfig(**values)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _transformers_text_config(model: str, cfg: dict) -> Any:
    from transformers import AutoConfig

    model_type = cfg.get("model_type") or _model_type_of(cfg.get("architectures") or [])
    if not model_type:
        raise ValueError(f"model={model!r}: config.json has no 'model_type', and its architectures "
                         f"{cfg.get('architectures')} name none transformers knows")
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        hf = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"model={model!r}: config.json (model_type={model_type!r}) is not a config transformers "
                         f"knows: {e}") from None
    return hf.get_text_config()


def _model_type_of(architectures: list[str]) -> str | None:
    """An old config.json without model_type: the model type whose causal-LM class the architectures name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_class = {cls: model_type for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    return next((by_class[a] for a in architectures if a in by_class), None)


# DeepSeek V4's compressed kinds (each also slides over sliding_window) are read by its model only.
_LAYER_TYPES = ("full_attention", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def _layer_types(model: str, tc: Any) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention kinds and the window, as HF derives them: the config's layer_types; without them every
    layer slides when the config class has a sliding_window field and it is set (Mistral), unless
    use_sliding_window is off."""
    num_layers = tc.num_hidden_layers
    window = getattr(tc, "sliding_window", None)
    declared = "sliding_window" in {f.name for f in dataclasses.fields(type(tc))} if dataclasses.is_dataclass(tc) \
        else hasattr(type(tc)(), "sliding_window")
    layer_types = getattr(tc, "layer_types", None)
    if layer_types is None:
        slides = declared and window is not None and getattr(tc, "use_sliding_window", True) is not False
        layer_types = ["sliding_attention" if slides else "full_attention"] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"model={model!r}: layer_types has {len(layer_types)} entries but num_hidden_layers is "
                         f"{num_layers}")
    for t in layer_types:
        if t not in _LAYER_TYPES:
            raise ValueError(f"model={model!r}: layer_types entry {t!r} is not supported; supported: "
                             f"{', '.join(_LAYER_TYPES)}")
    if window is None:  # as in HF: without a window, "sliding" layers attend to everything
        layer_types = ["full_attention"] * num_layers
    elif "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        # Qwen2-MoE writes 0 when use_sliding_window is off: no layer slides then, and the window is unused.
        raise ValueError(f"model={model!r}: sliding_window must be a positive integer, got {window!r}")
    if "sliding_attention" not in layer_types:
        window = None
    return tuple(layer_types), window


def _eos_token_ids(gen_cfg: dict, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen_cfg, cfg):
        eos = src.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return tuple(ids)


# What the KV cache stores, by vLLM's names: "auto" the model's dtype; "fp8" (= "fp8_e4m3") float8_e4m3fn with a
# per-tensor k_scale and v_scale per attention layer (from the checkpoint, else 1.0).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; overrides the fraction when given
    memory_fraction: float = 0.9  # of free memory (GPU) or of available RAM (CPU), after the weights
    num_gpu_blocks_override: int | None = None  # for tests: exact number of blocks per group
    kv_cache_dtype: str = "auto"  # a key of KV_CACHE_DTYPES

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV cache tensors under a model of `model_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype='fp8_e5m2' (--kv-cache-dtype) is not supported; use fp8 (fp8_e4m3: "
                             "more mantissa, per-tensor scales)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} (--kv-cache-dtype) is not supported; choose "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if not (isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128)):
            raise ValueError(f"block_size={self.block_size!r} must be a power of two in [1, 128]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} must be a positive number of bytes")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction={self.memory_fraction!r} must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override!r} must be >= 2")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # A chunk never ends inside an image's placeholder tokens: it stops before the image, which the next step takes
    # whole. Set for models whose image tokens attend to each other both ways (Gemma 3), which need every token of
    # an image in the step that computes any of them.
    disable_chunked_mm_input: bool = False
    # Schedule and launch step N+1 before step N's tokens reach the host: the host's work hides behind the device's.
    async_scheduling: bool = False
    # Image tokens the vision encoder may produce in one step (images not in its cache yet); None:
    # max_num_batched_tokens. One image larger than this (without chunked prefill: one prompt's images) runs alone.
    max_num_encoder_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens is None:
            object.__setattr__(self, "max_num_encoder_input_tokens", self.max_num_batched_tokens)
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_num_encoder_input_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                             f"{self.max_model_len} when chunked prefill is disabled")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over `nnodes` nodes, each running tensor_parallel_size / nnodes ranks; node 0 runs the
    engine, the others run headless workers. Ranks meet at master_addr:master_port (torch.distributed)."""
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, chosen at start-up (one node only)
    # Mixture-of-experts layers: each rank holds whole experts (E / tp of them) instead of a slice of every expert;
    # attention stays tensor-parallel. EP size = TP size. Every config derived from this one inherits it.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be True or False")
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise ValueError(f"node_rank={self.node_rank!r} must be an integer in [0, nnodes={self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not divide evenly across "
                             f"nnodes={self.nnodes}: every node runs the same number of ranks")
        if not (isinstance(self.master_addr, str) and self.master_addr):
            raise ValueError(f"master_addr={self.master_addr!r} must be a host name or IP address")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 1 <= self.master_port <= 65535):
            raise ValueError(f"master_port={self.master_port!r} must be an integer in [1, 65535]")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(f"master_port is required when nnodes={self.nnodes}: every node must name the same "
                             "master_addr and master_port")

    @property
    def local_world_size(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def in_process(self) -> bool:
        """One rank: the engine runs the model itself, with no worker processes and no collectives."""
        return self.tensor_parallel_size == 1

    @property
    def expert_parallel_size(self) -> int:
        return self.tensor_parallel_size if self.enable_expert_parallel else 1


WEIGHT_CACHE_MODES = ("zero_copy", "copy")


@dataclass(frozen=True)
class WeightCacheConfig:
    """How an engine with load_format="weight_cache" uses its daemons (surge/weight_cache)."""
    socket_dir: str | None = None  # None: $SURGE_WEIGHT_CACHE_DIR (see surge/envs.py)
    # zero_copy: bind the daemon's tensors (the daemon must outlive the engine); copy: clone them, then the daemon
    # releases its copy.
    mode: str = "zero_copy"
    fallback: bool = True  # any reason the cache cannot serve: warn and load from disk (off: fail with the reason)
    timeout: float = 30.0  # seconds to connect, and to wait for each reply

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_CACHE_MODES:
            raise ValueError(f"weight_cache_mode={self.mode!r} is not supported; choose "
                             f"{' or '.join(WEIGHT_CACHE_MODES)}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"weight_cache_timeout={self.timeout!r} must be a positive number of seconds")
        if self.socket_dir is not None and not (isinstance(self.socket_dir, str) and self.socket_dir):
            raise ValueError(f"weight_cache_dir={self.socket_dir!r} must be a directory path")


SPECULATIVE_METHODS = ("ngram", "draft_model", "deepseek_mtp")

# How a draft model's ParallelConfig follows the target's: every field has a policy, and a test fails for a field
# that has none (vLLM #55914: a draft config copied field by field silently dropped expert parallelism).
DRAFT_PARALLEL_POLICY: dict[str, tuple[str, str]] = {
    "tensor_parallel_size": ("override", "a small draft may run on one rank; else the target's size (its ranks)"),
    "nnodes": ("inherit", "the draft runs in the target's worker processes, on the same nodes"),
    "node_rank": ("inherit", "the same node as the target's engine"),
    "master_addr": ("inherit", "the draft's ranks are the target's: one rendezvous"),
    "master_port": ("inherit", "the same rendezvous; a second port would be a second process group to start"),
    "enable_expert_parallel": ("inherit", "a draft with experts splits them as the target does; a dense draft has "
                               "no layer it applies to"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as vLLM users write `--speculative-config`: a proposer method and k tokens per step.
    ngram: prompt lookup over the request's own tokens (prompt_lookup_min..max long matches); draft_model: a
    smaller model sharing the tokenizer (`model`), its tensor-parallel size 1 or the target's; deepseek_mtp: the
    target checkpoint's own multi-token-prediction layer (surge/model/models/deepseek_mtp.py), run k times
    recurrently, on the target's ranks."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: an HF-format directory, or a preset's name (random weights)
    draft_tensor_parallel_size: int | None = None  # None: the target's
    # draft_model: the draft's ModelConfig, derived by the engine's args from `model` (draft_model_config below);
    # not a key users write.
    draft: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported; choose "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16):
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer in [1, 16]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config.prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be "
                             "integers with 1 <= min <= max")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must name the draft model's directory for method "
                             "'draft_model'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model'; 'ngram' uses no model")
        if self.method == "deepseek_mtp" and self.draft_tensor_parallel_size is not None:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={self.draft_tensor_parallel_size}: the "
                             "'deepseek_mtp' draft runs on the target's ranks; leave it unset")
        if self.draft is not None and not isinstance(self.draft, ModelConfig):
            raise ValueError("speculative_config.draft is derived by the engine from 'model'; do not set it")

    @staticmethod
    def parse(value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From JSON text or a dict with the fields above; unknown keys are an error naming them."""
        return _parse_json_config(SpeculativeConfig, "speculative_config", value, ("method", "num_speculative_tokens"),
                                  '{"method": "ngram", "num_speculative_tokens": 3}')

    @property
    def uses_draft_model(self) -> bool:
        """A model proposes (surge/worker/draft_model.py), with its own KV cache layers in the target's blocks."""
        return self.method in ("draft_model", "deepseek_mtp")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a step's end that the draft writes: a draft model decodes k tokens from the new last one;
        the MTP layer's first draft comes from the step's own positions, its k - 1 others from decode passes."""
        return {"draft_model": self.num_speculative_tokens,
                "deepseek_mtp": self.num_speculative_tokens - 1}.get(self.method, 0)

    def draft_parallel_config(self, target: ParallelConfig) -> ParallelConfig:
        """The target's ParallelConfig, copied, with the overrides DRAFT_PARALLEL_POLICY names."""
        tp = target.tensor_parallel_size if self.draft_tensor_parallel_size is None else \
            self.draft_tensor_parallel_size
        if tp not in (1, target.tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp} must be 1 or the target's "
                             f"tensor_parallel_size={target.tensor_parallel_size}")
        if tp != target.tensor_parallel_size and target.nnodes > 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp}: a target spread over "
                             f"nnodes={target.nnodes} needs a draft on all its ranks (the target's size)")
        overrides = {"tensor_parallel_size": tp}
        assert set(overrides) == {f for f, (policy, _) in DRAFT_PARALLEL_POLICY.items() if policy == "override"}
        return dataclasses.replace(target, **overrides)

    def draft_model_config(self, target: ModelConfig, draft: ModelConfig) -> ModelConfig:
        """The draft's own architecture and weights (`draft`, read from its directory by the args layer), with the
        target's dtype, length and load format: the two must agree token for token and position for position."""
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model={self.model!r}: its vocabulary ({draft.vocab_size}) differs "
                             f"from the target's ({target.vocab_size}); the draft must share the tokenizer")
        return dataclasses.replace(draft, dtype=target.dtype, max_model_len=target.max_model_len,
                                   load_format=target.load_format)

    def mtp_model_config(self, target: ModelConfig) -> ModelConfig:
        """deepseek_mtp: the target's own config and checkpoint, whose one MTP layer (num_nextn_predict_layers = 1,
        as DeepSeek-V3/R1 ship it) is the draft: with more, each step would have to chain them to fill every one's
        KV cache, which is not implemented. `model`, if given, must be the target's directory. Read from disk even
        when the target comes from the weight cache, whose daemons hold the target's layers only."""
        if self.model is not None and os.path.normpath(self.model) != os.path.normpath(target.model):
            raise ValueError(f"speculative_config.model={self.model!r}: method 'deepseek_mtp' reads the target's "
                             f"own checkpoint ({target.model!r}); leave model unset")
        num = getattr(target.text_config, "num_nextn_predict_layers", None) or 0
        if num != 1:
            raise ValueError(f"speculative_config.method='deepseek_mtp' needs a checkpoint with one MTP layer; "
                             f"model={target.model!r} has num_nextn_predict_layers={num}")
        load_format = "safetensors" if target.load_format == "weight_cache" else target.load_format
        return dataclasses.replace(target, load_format=load_format)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (surge/kv_transfer), as vLLM users write `--kv-transfer-config`: the connector's name, the
    instance's role (producer saves, consumer loads, both both) and the connector's own settings."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict, hash=False, compare=False)
    # A module that defines (and registers) a connector of the engine's own: imported by every process.
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.kv_connector, str) and self.kv_connector):
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} must name a connector")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} is not supported; choose "
                             f"{', '.join(KV_ROLES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be an object, got "
                             f"{type(self.kv_connector_extra_config).__name__}")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @staticmethod
    def parse(value: str | dict | KVTransferConfig) -> KVTransferConfig:
        """From JSON text or a dict with the keys above; unknown keys are an error naming them."""
        return _parse_json_config(KVTransferConfig, "kv_transfer_config", value, ("kv_connector",),
                                  '{"kv_connector": "OffloadingConnector"}')


EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")


@dataclass(frozen=True)
class ECTransferConfig:
    """An encoder cache connector (surge/ec_transfer), as vLLM users write `--ec-transfer-config`: encoder
    disaggregation. An ec_producer instance is encoder-only (it encodes each request's images, saves the embeddings
    under their content hash and answers with no tokens); an ec_consumer instance loads an image's embeddings from
    the connector before encoding it itself (counted as a fallback when they are not there)."""
    ec_connector: str
    ec_role: str = "ec_consumer"
    ec_connector_extra_config: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.ec_connector, str) and self.ec_connector):
            raise ValueError(f"ec_transfer_config.ec_connector={self.ec_connector!r} must name a connector")
        if self.ec_role not in EC_ROLES:
            raise ValueError(f"ec_transfer_config.ec_role={self.ec_role!r} is not supported; choose "
                             f"{', '.join(EC_ROLES)}")
        if not isinstance(self.ec_connector_extra_config, dict):
            raise ValueError(f"ec_transfer_config.ec_connector_extra_config must be an object, got "
                             f"{type(self.ec_connector_extra_config).__name__}")

    @property
    def encoder_only(self) -> bool:
        """An encoder instance: it computes and saves embeddings, never a token."""
        return self.ec_role == "ec_producer"

    @property
    def loads(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @property
    def saves(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @staticmethod
    def parse(value: str | dict | ECTransferConfig) -> ECTransferConfig:
        return _parse_json_config(ECTransferConfig, "ec_transfer_config", value, ("ec_connector",),
                                  '{"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer", '
                                  '"ec_connector_extra_config": {"shared_storage_path": "/dev/shm/ec"}}')


def _parse_json_config(cls: type, name: str, value, required: tuple[str, ...], example: str):
    """A config written as JSON text (a CLI flag) or a dict (Python): an object whose keys are cls's fields."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{name} needs {missing} (e.g. {example})")
    return cls(**value)


# Architectures with an LM head: a decoder, or a vision-language model around one.
GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")
RUNNERS = ("generate", "pooling")  # EngineArgs also takes "auto": pooling for architectures without an LM head
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How the pooling runner turns a prompt's hidden states into one vector (vLLM's names; `--pooler-config`)."""
    pooling_type: str | None = None  # LAST, MEAN or CLS; None: LAST (decoder models)
    normalize: bool | None = None  # embeddings L2-normalized; None: yes
    dimensions: int | None = None  # a Matryoshka model's default output dimensions; None: all
    use_activation: bool | None = None  # classification: sigmoid (one label) or softmax; None: yes

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type={self.pooling_type!r} is not supported; choose one of "
                                 f"{', '.join(POOLING_TYPES)}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"pooler_config.{name}={value!r} must be true or false")
        if self.dimensions is not None and not (isinstance(self.dimensions, int) and self.dimensions >= 1):
            raise ValueError(f"pooler_config.dimensions={self.dimensions!r} must be a positive integer")

    @property
    def type(self) -> str:
        return self.pooling_type or "LAST"

    @staticmethod
    def parse(value: str | dict | PoolerConfig) -> PoolerConfig:
        return _parse_json_config(PoolerConfig, "pooler_config", value, (), '{"pooling_type": "MEAN"}')

    def merged(self, override: PoolerConfig | None) -> PoolerConfig:
        """This config with the override's fields that are set."""
        if override is None:
            return self
        return dataclasses.replace(self, **{f.name: getattr(override, f.name) for f in dataclasses.fields(self)
                                            if getattr(override, f.name) is not None})


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How the engine compiles structured-output grammars (surge/structured_output/)."""
    # The reasoning markers of the model (a name in surge/structured_output/reasoning.py): a request's grammar
    # starts after the closing one. None: from the first output token.
    reasoning_parser: str | None = None
    # The HF tokenizer directory the grammars are compiled against; None: the model's (a random-weight preset has
    # none, so its benchmarks name one).
    tokenizer: str | None = None


CUDA_GRAPH_CAPTURE_MODES = ("background", "startup")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: up to max_loras adapters in the device's slot pool (so in one step), each of rank up to
    max_lora_rank; max_cpu_loras adapters kept loaded in host memory (least recently used evicted)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is above the largest supported, {MAX_LORA_RANK}")
        if self.max_cpu_loras is not None and not (isinstance(self.max_cpu_loras, int)
                                                   and self.max_cpu_loras >= self.max_loras):
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras!r} must be an integer >= max_loras={self.max_loras}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


MAX_LORA_RANK = 512


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: torch.device
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs (always so off CUDA)
    warmup_workers: int = 1  # kernel warm-up compile threads; 1 is serial (the default), kernels opt in to more
    # "startup": every graph before serving. "background": a thread warms the kernels up and captures every graph
    # from the first step on, while the engine serves (one GPU only; under tensor parallelism every graph is
    # captured at start-up). A device-wide synchronize in the engine's process during a capture would break it, so
    # background is for a process that runs only the engine (`surge serve`'s engine core), not for one shared with a
    # user's script.
    cuda_graph_capture: str = "startup"
    weight_cache_config: WeightCacheConfig = field(default_factory=WeightCacheConfig)
    kv_transfer_config: KVTransferConfig | None = None  # None: no KV connector
    ec_transfer_config: ECTransferConfig | None = None  # None: images are encoded here, by this instance alone
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig | None = None  # None: no LoRA adapters (the base model's layers untouched)

    def __post_init__(self) -> None:
        if not (isinstance(self.warmup_workers, int) and 1 <= self.warmup_workers <= 64):
            raise ValueError(f"warmup_workers={self.warmup_workers!r} must be an integer in [1, 64] (1: serial)")
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURE_MODES:
            raise ValueError(f"cuda_graph_capture={self.cuda_graph_capture!r} must be one of "
                             f"{', '.join(CUDA_GRAPH_CAPTURE_MODES)}")


def read_json_object(file: Path, owner: str) -> dict:
    """A JSON object from `file`, or a ValueError naming `owner` and the file (missing, not JSON, not an object)."""
    if not file.is_file():
        raise ValueError(f"{owner}: {file.name} is missing")
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{owner}: {file.name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{owner}: {file.name} must hold a JSON object")
    return value
