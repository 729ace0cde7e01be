"""Sampling flags of the subcommands that generate (generate, chat), mapped onto SamplingParams. Engine flags are
EngineArgs's (surge/engine/args.py)."""
from __future__ import annotations

import argparse

from surge.sampling_params import SamplingParams


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
