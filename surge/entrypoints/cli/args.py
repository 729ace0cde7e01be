"""Command-line flags shared by every subcommand: engine options and sampling options, mapped onto
EngineConfig.create keyword arguments and SamplingParams."""
from __future__ import annotations

import argparse

from surge.config import LOAD_FORMATS, WEIGHT_CACHE_MODES
from surge.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help="HF-format model directory (default: the embedded "
                       "SmolLM2-135M-Instruct)")
    else:
        p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded "
                       "SmolLM2-135M-Instruct)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")
    g.add_argument("--memory-fraction", type=float, default=0.9, help="share of free memory for the KV cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--engine-seed", type=int, default=0, help="seed of the global RNG")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous step's tokens reach the host (default: on with CUDA)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks the model is split over")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are spread over (one launcher per node)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index; nodes other than 0 run headless "
                   "workers until node 0's engine stops")
    g.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, where the ranks meet")
    g.add_argument("--master-port", type=int, default=None, help="port on node 0 where the ranks meet (required "
                   "with --nnodes > 1; default: a free port)")
    g = p.add_argument_group("loading (Fast Start: `surge weight-cache serve` keeps the weights loaded)")
    g.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                   help="weight_cache: map the weights from this node's weight-cache daemons")
    g.add_argument("--weight-cache-dir", default=None, help="the daemons' socket directory (default: "
                   "$SURGE_WEIGHT_CACHE_DIR or /tmp/surge-weight-cache-UID)")
    g.add_argument("--weight-cache-mode", default="zero_copy", choices=list(WEIGHT_CACHE_MODES),
                   help="zero_copy: use the daemon's memory (the daemon must outlive the engine); copy: clone it, "
                   "then the daemon releases its copy")
    g.add_argument("--no-weight-cache-fallback", action="store_true",
                   help="fail, stating the reason, when the weight cache cannot serve (default: load from disk)")
    g.add_argument("--weight-cache-timeout", type=float, default=30.0,
                   help="seconds to connect to a daemon and to wait for each reply")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_memory=args.kv_cache_memory, memory_fraction=args.memory_fraction,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                seed=args.engine_seed, tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                load_format=args.load_format, weight_cache_dir=args.weight_cache_dir,
                weight_cache_mode=args.weight_cache_mode, weight_cache_fallback=not args.no_weight_cache_fallback,
                weight_cache_timeout=args.weight_cache_timeout,
                async_scheduling=args.async_scheduling)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", "--n", type=int, default=1, help="samples per prompt")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, stop=args.stop, ignore_eos=args.ignore_eos)
