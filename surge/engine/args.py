"""EngineArgs: every user-facing engine option with its default, given as keyword arguments (LLM, AsyncLLM) or as
command-line flags (the CLI, the server, the benchmarks), and turned into a frozen EngineConfig.

This is where options meet the disk: config.json and generation_config.json are read, the default model is
converted from its GGUF, presets are looked up; surge/config.py only validates what it is given.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import surge.weight_cache.ipc_loader  # noqa: F401 (registers the weight_cache load format)
from surge.config import (CUDA_GRAPH_CAPTURE_MODES, RUNNERS, WEIGHT_CACHE_MODES, CacheConfig, EngineConfig,
                          ECTransferConfig, KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig, PoolerConfig,
                          SchedulerConfig, read_json_object,
                          SpeculativeConfig, StructuredOutputsConfig, WeightCacheConfig)
from surge.engine.sentence_transformers_config import read_pooler_config
from surge.model.loader.base import load_formats
from surge.model.models.registry import SUPPORTED_ARCHITECTURES, get_model_class, get_mtp_model_class
from surge.model.presets import PRESETS, preset_model_config
from surge.structured_output.reasoning import REASONING_MARKERS

# "auto": the checkpoint of a model directory, random weights for a preset.
AUTO_LOAD_FORMAT = "auto"
_MODEL_HELP = "HF-format model directory (default: the embedded SmolLM2-135M-Instruct)"
# Fields whose flag has another name (--seed is the sampling seed) or says the opposite: field -> (dest, negated).
_CLI_DESTS = {"seed": ("engine_seed", False), "enable_prefix_caching": ("no_prefix_caching", True),
              "weight_cache_fallback": ("no_weight_cache_fallback", True)}


@dataclass(frozen=True)
class EngineArgs:
    model: str | Path | None = None  # None (and no preset): the default model
    _: dataclasses.KW_ONLY
    dtype: str | torch.dtype = "auto"
    device: str | None = None  # None: cuda when available
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # "fp8" (fp8_e4m3): float8 keys and values, per-tensor scales
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len when chunked prefill is off
    max_num_seqs: int = 128
    max_num_encoder_input_tokens: int | None = None  # None: max_num_batched_tokens
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE layers: whole experts per rank (EP size = TP size)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    seed: int = 0
    preset: str | None = None  # a built-in config with random weights, instead of a model directory
    load_format: str = AUTO_LOAD_FORMAT
    enforce_eager: bool = False
    warmup_workers: int = 1
    cuda_graph_capture: str = "startup"  # or "background" (surge serve's default): see EngineConfig
    weight_cache_dir: str | None = None
    weight_cache_mode: str = "zero_copy"
    weight_cache_fallback: bool = True
    weight_cache_timeout: float = 30.0
    async_scheduling: bool | None = None  # None: on with CUDA
    # A KV connector, as JSON text or a dict: {"kv_connector": NAME, "kv_role": "kv_both", ...}.
    kv_transfer_config: str | dict | None = None
    kv_offload_gib: float | None = None  # the CPU offload tier's size: OffloadingConnector, unless one is named
    kv_transfer_timeout: float | None = None  # prefill -> decode: seconds a finished request's blocks wait to be read
    # Encoder disaggregation, as JSON text or a dict: {"ec_connector": NAME, "ec_role": "ec_producer", ...}.
    ec_transfer_config: str | dict | None = None
    # Speculative decoding, as JSON text or a dict: {"method": "ngram", "num_speculative_tokens": k, ...}.
    speculative_config: str | dict | None = None
    # Reasoning models: the name of the markers around the reasoning text (surge/structured_output/reasoning.py); a
    # request's grammar starts after the closing marker, and the server returns the reasoning apart.
    reasoning_parser: str | None = None
    # "generate", "pooling" (embeddings, classification, scores: prefill only), or "auto": pooling for an
    # architecture without an LM head.
    runner: str = "auto"
    # The pooling runner's pooler, as JSON text or a dict ({"pooling_type": "MEAN", "normalize": false}), over the
    # checkpoint's sentence-transformers files.
    pooler_config: str | dict | None = None
    # Keys merged over config.json, as JSON text or a dict (e.g. a decoder reranker's
    # {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], ...}).
    hf_overrides: str | dict | None = None
    # Most items of each modality in one prompt, as JSON text or a dict ({"image": 4}); a multimodal model only.
    limit_mm_per_prompt: str | dict | None = None
    # Images from local files under this directory (file:// URLs, absolute paths) and from http(s) URLs of these
    # hosts (a list, or comma-separated); both off by default: only data: URLs.
    allowed_local_media_path: str | None = None
    allowed_media_domains: str | list[str] | None = None
    # Online quantization of an unquantized checkpoint ("fp8": per-channel weights, per-token activations); a
    # quantized checkpoint brings its own (quantization_config), which this may only name again.
    quantization: str | None = None
    # LoRA adapters per request (LLM.generate(lora_request=...), the server's --lora-modules): up to max_loras of
    # them in one step, of rank up to max_lora_rank; max_cpu_loras loaded in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    # ---- command line ----
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
        d = EngineArgs
        if model_positional:
            p.add_argument("model", nargs="?", default=d.model, help=_MODEL_HELP)
        else:
            p.add_argument("--model", default=d.model, help=_MODEL_HELP)
        g = p.add_argument_group("engine")
        g.add_argument("--dtype", default=d.dtype,
                       help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
        g.add_argument("--device", default=d.device, help="cpu or cuda (default: cuda when available)")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len)
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
        g.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="KV cache budget in bytes")
        g.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                       help="share of free memory for the KV cache")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, help="auto (the model's dtype), fp8 or "
                       "fp8_e4m3: the KV cache stores float8_e4m3fn (twice the tokens of bf16), scaled per layer by "
                       "the checkpoint's k_scale / v_scale where it has them, else 1.0")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget per step")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-encoder-input-tokens", type=int, default=d.max_num_encoder_input_tokens,
                       help="image tokens the vision encoder may produce per step (default: "
                       "--max-num-batched-tokens); a prompt chunk whose new image does not fit waits")
        g.add_argument("--engine-seed", type=int, default=d.seed, help="seed of the global RNG")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                       help="launch each step before the previous step's tokens reach the host (default: on with "
                       "CUDA)")
        g.add_argument("--cuda-graph-capture", choices=CUDA_GRAPH_CAPTURE_MODES, default=d.cuda_graph_capture,
                       help="startup: every graph before serving; background: the batch-1 decode graph at "
                       "start-up, the others while serving (one GPU). Default: background for `surge serve` and "
                       "`bench startup`, whose engine processes run nothing else; startup elsewhere")
        g = p.add_argument_group("parallelism")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="ranks the model is split over")
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="mixture-of-experts layers: each rank holds whole experts (E / tp of them) instead of a "
                       "slice of every expert; attention stays tensor-parallel")
        g.add_argument("--nnodes", type=int, default=d.nnodes,
                       help="nodes the ranks are spread over (one launcher per node)")
        g.add_argument("--node-rank", type=int, default=d.node_rank, help="this node's index; nodes other than 0 "
                       "run headless workers until node 0's engine stops")
        g.add_argument("--master-addr", default=d.master_addr, help="address of node 0, where the ranks meet")
        g.add_argument("--master-port", type=int, default=d.master_port, help="port on node 0 where the ranks meet "
                       "(required with --nnodes > 1; default: a free port)")
        g.add_argument("--speculative-config", default=d.speculative_config, help="speculative decoding as JSON, "
                       "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' "
                       "(greedy requests are verified exactly; others decode as without it)")
        g.add_argument("--runner", default=d.runner, choices=("auto", *RUNNERS),
                       help="pooling: embeddings, classification and scores (prefill only); auto: pooling for "
                       "architectures without an LM head")
        g.add_argument("--pooler-config", default=d.pooler_config, help="the pooling runner's pooler as JSON, e.g. "
                       "'{\"pooling_type\": \"MEAN\", \"normalize\": false}' (over the checkpoint's "
                       "sentence-transformers files)")
        g.add_argument("--limit-mm-per-prompt", default=d.limit_mm_per_prompt, help="most images in one prompt "
                       "as JSON, e.g. '{\"image\": 4}' (default 16)")
        g.add_argument("--allowed-local-media-path", default=d.allowed_local_media_path, help="read images of "
                       "file:// URLs and absolute paths under this directory (default: no local files)")
        g.add_argument("--allowed-media-domains", default=d.allowed_media_domains, help="fetch images of http(s) "
                       "URLs from these hosts, comma-separated, e.g. 'upload.wikimedia.org,127.0.0.1' (default: "
                       "no remote images); a fetch is bounded in bytes, seconds and pixels")
        g.add_argument("--quantization", "-q", default=d.quantization,
                       help="fp8: quantize an unquantized checkpoint's linear layers as they load (per-channel fp8 "
                       "weights, per-token dynamic fp8 activations); quantized checkpoints need no flag")
        g.add_argument("--hf-overrides", "--hf_overrides", default=d.hf_overrides,
                       help="JSON merged over config.json, e.g. '{\"is_matryoshka\": true}'")
        g.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=sorted(REASONING_MARKERS),
                       help="the model writes reasoning between these markers: the server returns it as "
                       "reasoning_content, and structured output constrains only the text after it")
        g = p.add_argument_group("LoRA adapters")
        g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) per request")
        g.add_argument("--max-loras", type=int, default=d.max_loras, help="adapters in one step (device slots)")
        g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank")
        g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                       help="adapters kept loaded in host memory (default: --max-loras)")
        g = p.add_argument_group("KV transfer (reuse prefixes across restarts and instances)")
        g.add_argument("--kv-transfer-config", default=d.kv_transfer_config, help="a KV connector as JSON, e.g. "
                       "'{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                       "\"kv_connector_extra_config\": {\"cpu_gib\": 8}}' (connectors: OffloadingConnector, "
                       "MooncakeStoreConnector)")
        g.add_argument("--kv-offload-gib", type=float, default=d.kv_offload_gib, help="size of the CPU offload "
                       "tier in GiB: KV blocks of finished prefixes kept in (pinned) host memory, loaded back on a "
                       "later hit (the OffloadingConnector)")
        g.add_argument("--kv-transfer-timeout", type=float, default=d.kv_transfer_timeout, help="prefill instance "
                       "(MooncakeTransferConnector): seconds a finished request's KV blocks wait for the decode "
                       "instance to read them before they are freed (default 30)")
        g.add_argument("--ec-transfer-config", default=d.ec_transfer_config, help="encoder disaggregation: an "
                       "encoder cache connector as JSON, e.g. '{\"ec_connector\": \"ECSharedStorageConnector\", "
                       "\"ec_role\": \"ec_producer\", \"ec_connector_extra_config\": {\"shared_storage_path\": "
                       "\"/dev/shm/ec\"}}'. ec_producer: an encoder-only instance (`surge proxy --encode`); "
                       "ec_consumer: a prefill (or combined) instance that loads the embeddings, encoding an image "
                       "itself when they are missing (surge:encoder_fallback_total)")
        g = p.add_argument_group("loading (Fast Start: `surge weight-cache serve` keeps the weights loaded)")
        g.add_argument("--load-format", default=d.load_format, choices=list(_load_format_choices()),
                       help="weight_cache: map the weights from this node's weight-cache daemons")
        g.add_argument("--weight-cache-dir", default=d.weight_cache_dir, help="the daemons' socket directory "
                       "(default: $SURGE_WEIGHT_CACHE_DIR or /tmp/surge-weight-cache-UID)")
        g.add_argument("--weight-cache-mode", default=d.weight_cache_mode, choices=list(WEIGHT_CACHE_MODES),
                       help="zero_copy: use the daemon's memory (the daemon must outlive the engine); copy: clone "
                       "it, then the daemon releases its copy")
        g.add_argument("--no-weight-cache-fallback", action="store_true",
                       help="fail, stating the reason, when the weight cache cannot serve (default: load from disk)")
        g.add_argument("--weight-cache-timeout", type=float, default=d.weight_cache_timeout,
                       help="seconds to connect to a daemon and to wait for each reply")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Every field whose flag the parser defined: add_cli_args's, and those a subcommand adds under the field's
        own name (the benchmarks' --preset, --enforce-eager, --warmup-workers)."""
        values = {}
        for f in dataclasses.fields(cls):
            dest, negated = _CLI_DESTS.get(f.name, (f.name, False))
            if hasattr(args, dest):
                value = getattr(args, dest)
                values[f.name] = not value if negated else value
        return cls(**values)

    # ---- configs ----
    def create_engine_config(self) -> EngineConfig:
        formats = _load_format_choices()
        if self.load_format not in formats:
            raise ValueError(f"load_format={self.load_format!r} is not supported; choose {', '.join(formats)}")
        weight_cache_config = WeightCacheConfig(
            socket_dir=None if self.weight_cache_dir is None else str(self.weight_cache_dir),
            mode=self.weight_cache_mode, fallback=self.weight_cache_fallback, timeout=self.weight_cache_timeout)
        if self.preset is not None and self.model is not None:
            raise ValueError(f"give model or preset, not both (model={str(self.model)!r}, preset={self.preset!r})")
        device = _resolve_device(self.device)
        model_config = self.create_model_config(device)
        parallel_config = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes,
                                         node_rank=self.node_rank, master_addr=self.master_addr,
                                         master_port=self.master_port,
                                         enable_expert_parallel=self.enable_expert_parallel)
        model_class = get_model_class(model_config.architecture, model_config.runner)
        model_class.check_parallel(model_config, parallel_config)
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, model_config.max_model_len)
        return EngineConfig(
            model_config=model_config,
            # Mean and first-token pooling read every prompt position: a prefix-cache hit would skip some.
            cache_config=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching
                                     and (model_config.runner != "pooling" or model_config.pooler_config.type == "LAST"),
                                     kv_cache_memory=self.kv_cache_memory, memory_fraction=self.memory_fraction,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     kv_cache_dtype=self.kv_cache_dtype),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                             max_num_seqs=self.max_num_seqs, max_model_len=model_config.max_model_len,
                                             enable_chunked_prefill=self.enable_chunked_prefill,
                                             max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                                             # Gemma 3: an image's tokens see each other, so one step computes them
                                             disable_chunked_mm_input=getattr(model_class,
                                                                              "bidirectional_image_attention", False),
                                             # on by default where the device runs apart from the host
                                             async_scheduling=device.type == "cuda" if self.async_scheduling is None
                                             else bool(self.async_scheduling)),
            parallel_config=parallel_config,
            device=device,
            seed=self.seed,
            enforce_eager=self.enforce_eager or device.type != "cuda",
            warmup_workers=self.warmup_workers,
            cuda_graph_capture=self.cuda_graph_capture,
            weight_cache_config=weight_cache_config,
            kv_transfer_config=self.create_kv_transfer_config(),
            ec_transfer_config=None if self.ec_transfer_config is None else
            ECTransferConfig.parse(self.ec_transfer_config),
            speculative_config=self.create_speculative_config(model_config, device),
            structured_outputs_config=self.create_structured_outputs_config(),
            lora_config=self.create_lora_config(),
        )

    def create_lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                if getattr(self, name) != getattr(EngineArgs, name):
                    raise ValueError(f"{name}={getattr(self, name)!r} needs enable_lora=True (--enable-lora)")
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def create_structured_outputs_config(self) -> StructuredOutputsConfig:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_MARKERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is unknown; choose one of "
                             f"{', '.join(sorted(REASONING_MARKERS))}")
        return StructuredOutputsConfig(reasoning_parser=self.reasoning_parser)

    def create_speculative_config(self, target: ModelConfig, device: torch.device) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.parse(self.speculative_config)
        if config.method == "deepseek_mtp":
            get_mtp_model_class(target.architecture)  # refuses an architecture without one, by name
            return dataclasses.replace(config, draft=config.mtp_model_config(target))
        if config.method != "draft_model":
            return config
        # The draft at the target's length: a draft that cannot reach it fails here, naming itself.
        if config.model in PRESETS:  # random weights, like a preset target's
            draft = preset_model_config(config.model, target.dtype, device, target.max_model_len)
            draft = dataclasses.replace(config.draft_model_config(target, draft), load_format="dummy")
        else:
            draft = config.draft_model_config(target, read_model_config(config.model, target.dtype, device,
                                                                        target.max_model_len))
        return dataclasses.replace(config, draft=draft)

    def create_kv_transfer_config(self) -> KVTransferConfig | None:
        if self.kv_offload_gib is not None and not (isinstance(self.kv_offload_gib, (int, float))
                                                    and self.kv_offload_gib > 0):
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib!r} must be a positive number of GiB")
        if self.kv_transfer_config is None:
            if self.kv_transfer_timeout is not None:
                raise ValueError("kv_transfer_timeout (--kv-transfer-timeout) needs a kv_transfer_config naming the "
                                 "MooncakeTransferConnector")
            if self.kv_offload_gib is None:
                return None
            return KVTransferConfig("OffloadingConnector", "kv_both", {"cpu_gib": float(self.kv_offload_gib)})
        config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_timeout is not None:
            if not (isinstance(self.kv_transfer_timeout, (int, float)) and self.kv_transfer_timeout > 0):
                raise ValueError(f"kv_transfer_timeout={self.kv_transfer_timeout!r} must be a positive number of "
                                 "seconds")
            extra = {**config.kv_connector_extra_config, "timeout_s": float(self.kv_transfer_timeout)}
            config = dataclasses.replace(config, kv_connector_extra_config=extra)
        if self.kv_offload_gib is not None:
            extra = {"cpu_gib": float(self.kv_offload_gib), **config.kv_connector_extra_config}
            config = dataclasses.replace(config, kv_connector_extra_config=extra)
        return config

    def create_model_config(self, device: torch.device) -> ModelConfig:
        model_config = dataclasses.replace(self._model_config(device), **self._media_sources())
        if self.quantization is not None or model_config.quantization_config is not None:
            from surge.model.quant import get_quant_config
            get_quant_config(model_config.quantization_config, self.quantization)  # refuses what it cannot run
            if self.quantization == "w4a16" and model_config.load_format != "dummy":
                raise ValueError("quantization='w4a16' makes random int4 weights for a preset (load_format dummy); "
                                 "an unquantized checkpoint is quantized to int4 offline (llm-compressor W4A16)")
            model_config = dataclasses.replace(model_config, quantization=self.quantization)
        return model_config

    def _model_config(self, device: torch.device) -> ModelConfig:
        """From the preset, or from the model directory (the default model's, converted on first use)."""
        if self.preset is not None:
            if self.load_format not in (AUTO_LOAD_FORMAT, "dummy"):
                raise ValueError(f"preset={self.preset!r} has no checkpoint for load_format={self.load_format!r}: "
                                 "use load_format='dummy' (random weights), or write one with `surge bench startup "
                                 "--preset NAME --checkpoint-dir DIR`")
            model_config = preset_model_config(self.preset, self.dtype, device, self.max_model_len)
            if self.runner == "pooling":  # a preset's random weights, pooled
                model_config = dataclasses.replace(model_config, runner="pooling",
                                                   pooler_config=PoolerConfig().merged(self._user_pooler_config()))
            return model_config
        model = self.model
        if model is None:
            from surge.model.loader.default_model import default_model_path  # converts the GGUF on first use
            model = default_model_path()
        model_config = read_model_config(model, self.dtype, device, self.max_model_len, self.runner,
                                         self._user_pooler_config(), _json_object(self.hf_overrides, "hf_overrides"),
                                         weights=self.load_format != "dummy")
        if self.pooler_config is not None and model_config.runner != "pooling":
            raise ValueError(f"pooler_config={self.pooler_config!r} is for the pooling runner; this model runs with "
                             f"runner={model_config.runner!r} (pass runner='pooling', --runner pooling)")
        if self.load_format != AUTO_LOAD_FORMAT:
            model_config = dataclasses.replace(model_config, load_format=self.load_format)
        limits = _json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt")
        for modality, limit in limits.items():
            if modality != "image" or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt={limits!r}: only 'image' with a count >= 0 is supported")
        if limits:
            model_config = dataclasses.replace(model_config, limit_mm_per_prompt=limits)
        return model_config

    def _media_sources(self) -> dict:
        """allowed_local_media_path (an existing directory, resolved) and allowed_media_domains (host names)."""
        path = self.allowed_local_media_path
        if path is not None:
            if not Path(path).is_dir():
                raise ValueError(f"allowed_local_media_path={path!r} is not a directory")
            path = str(Path(path).resolve())
        domains = self.allowed_media_domains or []
        if isinstance(domains, str):
            domains = domains.split(",")
        domains = [d.strip().lower() for d in domains]
        bad = [d for d in domains if not d or "/" in d or ":" in d]
        if bad:
            raise ValueError(f"allowed_media_domains={self.allowed_media_domains!r}: give host names "
                             "(comma-separated), without scheme, port or path")
        return dict(allowed_local_media_path=path, allowed_media_domains=tuple(domains))

    def _user_pooler_config(self) -> PoolerConfig | None:
        if self.runner not in ("auto", *RUNNERS):
            raise ValueError(f"runner={self.runner!r} is not supported; choose one of auto, {', '.join(RUNNERS)}")
        return None if self.pooler_config is None else PoolerConfig.parse(self.pooler_config)


def _json_object(value: str | dict | None, name: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value or {}


def read_model_config(model: str | Path, dtype: str | torch.dtype, device: torch.device,
                      max_model_len: int | None = None, runner: str = "auto",
                      pooler_config: PoolerConfig | None = None, hf_overrides: dict | None = None,
                      weights: bool = True) -> ModelConfig:
    """The ModelConfig of an HF-format directory: config.json (hf_overrides merged over it), generation_config.json,
    and *.safetensors present unless `weights` is False (load_format dummy: a directory of config and tokenizer files
    serves with random weights, as `surge preset-dir` writes one). The pooling runner's pooler: the
    sentence-transformers files', then pooler_config's fields over it."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model={str(model)!r}: not a directory; expected an HF-format model directory "
                         "(config.json, *.safetensors, tokenizer files). Models are never fetched from a hub.")
    cfg = read_json_object(path / "config.json", f"model={str(model)!r}")
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"model={str(model)!r}: no *.safetensors weight files found (load_format 'dummy' serves a "
                         "directory without weights)")
    gen = path / "generation_config.json"
    gen_cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    cfg = {**cfg, **(hf_overrides or {})}
    pooler = (read_pooler_config(path) or PoolerConfig()).merged(pooler_config) if runner != "generate" else None
    tokens = cfg.get("classifier_from_token")
    return ModelConfig.from_hf_config(str(path), cfg, gen_cfg, dtype, device, max_model_len,
                                      supported_architectures=SUPPORTED_ARCHITECTURES, runner=runner,
                                      pooler_config=pooler,
                                      classifier_token_ids=_token_ids(path, tokens) if tokens else ())


def _token_ids(model_dir: Path, tokens) -> tuple[int, ...]:
    """classifier_from_token's tokens as the model's tokenizer numbers them; each must be one token."""
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token={tokens!r} must be a non-empty list of token strings")
    from surge.engine.input_processor import load_tokenizer
    tokenizer = load_tokenizer(model_dir)
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token: {token!r} is not one token of model={str(model_dir)!r}'s "
                             "vocabulary")
        ids.append(token_id)
    return tuple(ids)


def _load_format_choices() -> tuple[str, ...]:
    return (AUTO_LOAD_FORMAT, *load_formats())


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a valid torch device (try 'cpu' or 'cuda')") from None
