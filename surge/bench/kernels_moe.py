"""The fused MoE's decode paths on the GPU (`python -m surge.bench.kernels --only moe`, before check_moe's table):
Qwen3-30B-A3B's MoE layer (128 experts, top 8, hidden 2048, intermediate 768) at M = 1, 4, 16, 64 tokens.

For each M, the old path beside the new one, in us and in GB/s of the weight bytes of the experts the batch reaches
(3 x 2048 x 768 bf16 each, 75.5 MB at M = 1):
- experts: the grouped path (gate|up, down and combine on an alignment made beforehand) and the pair path's two
  kernels (at M = 64 the policy keeps the grouped path; the pair path is shown forced, for the boundary's sake);
- layer: the router kernel and fused_moe (alignment included) under the grouped launch, and under the policy's;
  a layer's MoE work but the router GEMM.
Then the routing simulation (SURGE_MOE_ROUTING_SIMULATION=uniform_random, which prof-moe and the vLLM comparison
use): torch.rand + topk + cast + fill before, torch.rand + the router kernel now.

`--only moe-sweep`: pair-path tiles at M = 1 and 16 (block rows x K step, 4 warps, software pipeline of 1 or 2
stages; the policy's tile with 2 and 8 warps), one kernel's tiles varied at a time (the other at the policy's), the
best five of each beside the policy's own: what to set PAIR_PROGRAMS, PAIR_STEP_ELEMENTS, the block bounds and
PairTiles' stages in surge/kernels/fused_moe.py from.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch

DTYPE = torch.bfloat16
LAYERS = 48  # Qwen3-30B-A3B's MoE layers


@dataclasses.dataclass(frozen=True)
class MoeShape:
    experts: int = 128  # Qwen3-30B-A3B
    top_k: int = 8
    hidden: int = 2048
    inter: int = 768
    device: str = "cuda"  # a tiny shape on "cpu" under TRITON_INTERPRET=1 runs this file's code in the tests

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.inter * DTYPE.itemsize

    def experts_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=self.device).manual_seed(1)
        gate_up = torch.randn(self.experts, 2 * self.inter, self.hidden, device=self.device, generator=g)
        down = torch.randn(self.experts, self.hidden, self.inter, device=self.device, generator=g)
        return (gate_up / self.hidden ** 0.5).to(DTYPE), (down / self.inter ** 0.5).to(DTYPE)

    def batch(self, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, router logits): the MoE block's input and its router GEMM's output."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(tokens, self.hidden, device=self.device, generator=g).to(DTYPE)
        return x, torch.randn(tokens, self.experts, device=self.device, generator=g).to(DTYPE)


def check_moe_paths(bench: Callable, report: Callable, max_err: Callable, batches: tuple[int, ...] = (1, 4, 16, 64),
                    shape: MoeShape = MoeShape()) -> None:
    from surge.kernels.fused_moe import fused_moe, grouped_experts, launch_policy, pair_experts, pair_launch
    from surge.kernels.moe_routing import align_to_blocks, route
    from surge.kernels.reference import fused_moe as torch_moe
    from surge.model.layers.moe import uniform_random_routing

    gate_up, down = shape.experts_weights()
    experts, top_k, hidden, inter = shape.experts, shape.top_k, shape.hidden, shape.inter
    print(f"# MoE decode paths, Qwen3-30B-A3B's layer ({experts} experts, top {top_k}, hidden {hidden}, "
          f"intermediate {inter}); GB/s of the reached experts' weight bytes")
    summary = []
    for tokens in batches:
        x, logits = shape.batch(tokens)
        weights, ids = route(logits, top_k, True, DTYPE)
        reached = ids.unique().numel()
        nbytes = reached * shape.expert_bytes
        used = ids.unique().long()
        local = torch.searchsorted(used, ids.long())  # the reference on the reached experts only (float32 copies)
        expected = torch_moe(x.float(), gate_up[used].float(), down[used].float(), weights.float(), local)
        policy = launch_policy(tokens, top_k, experts, hidden, inter)
        grouped = dataclasses.replace(policy, pairs=None)
        pairs = policy.pairs or pair_launch(tokens, top_k, hidden, inter)
        aligned = align_to_blocks(ids, experts, grouped.block_m)

        old = bench(lambda: grouped_experts(x, gate_up, down, weights, ids, *aligned, grouped))
        report(f"moe T={tokens} experts grouped", old, nbytes=nbytes, tol=2e-2,
               err=max_err(grouped_experts(x, gate_up, down, weights, ids, *aligned, grouped), expected),
               extra=f"{reached} experts; gate|up, down, combine (block_m {grouped.block_m})")
        new = bench(lambda: pair_experts(x, gate_up, down, weights, ids, pairs))
        tag = "policy" if policy.pairs else "forced; the policy's is grouped"
        report(f"moe T={tokens} experts pair ({tag})", new, nbytes=nbytes, tol=2e-2,
               err=max_err(pair_experts(x, gate_up, down, weights, ids, pairs), expected),
               extra=f"{old / new:.2f}x grouped; gate|up {pairs.gate_up.block_n}x{pairs.gate_up.block_k}, "
                     f"down {pairs.down.block_n}x{pairs.down.block_k}")

        old_layer = bench(lambda: fused_moe(x, gate_up, down, *route(logits, top_k, True, DTYPE), launch=grouped))
        report(f"moe T={tokens} router+fused_moe grouped", old_layer, nbytes=nbytes,
               extra="router, alignment, gate|up, down, combine")
        new_layer = bench(lambda: fused_moe(x, gate_up, down, *route(logits, top_k, True, DTYPE), launch=policy))
        report(f"moe T={tokens} router+fused_moe policy", new_layer, nbytes=nbytes,
               extra=f"{old_layer / new_layer:.2f}x grouped; {'pair path' if policy.pairs else 'grouped path'}")
        summary.append((tokens, old_layer, new_layer, nbytes))

    def simulated_before(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.rand(logits.shape, device=logits.device)
        ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
        return torch.full(ids.shape, 1.0 / top_k, dtype=DTYPE, device=ids.device), ids

    for tokens in (1, 64):
        _, logits = shape.batch(tokens)
        before = bench(lambda: simulated_before(logits))
        now = bench(lambda: uniform_random_routing(logits, top_k, DTYPE))
        report(f"moe T={tokens} routing simulation", now, extra=f"before {before * 1e6:.1f} us (rand, topk, cast, "
                                                                f"fill); now rand + router kernel")
    print(f"# MoE layer but the router GEMM, old (grouped) vs new (policy): M, us old, us new, GB/s old, GB/s new, "
          f"ms a step over {LAYERS} layers old, new")
    for tokens, old_layer, new_layer, nbytes in summary:
        print(f"moe-layer M={tokens:<3} {old_layer * 1e6:8.1f} {new_layer * 1e6:8.1f} {nbytes / old_layer / 1e9:7.0f} "
              f"{nbytes / new_layer / 1e9:7.0f} {old_layer * LAYERS * 1e3:6.2f} {new_layer * LAYERS * 1e3:6.2f}  "
              f"({old_layer / new_layer:.2f}x)", flush=True)


def check_moe_sweep(bench: Callable, report: Callable, batches: tuple[int, ...] = (1, 16),
                    shape: MoeShape = MoeShape()) -> None:
    from surge.kernels.fused_moe import PairTiles, pair_experts, pair_launch
    from surge.kernels.moe_routing import route

    gate_up, down = shape.experts_weights()
    top_k, hidden, inter = shape.top_k, shape.hidden, shape.inter
    tiles = [PairTiles(n, k, 4, stages)
             for n, k, stages in itertools.product((4, 8, 16, 32, 64), (64, 128, 256), (1, 2))]
    print("# pair-path tile sweep (the pair path's two kernels timed together; one kernel's tiles varied)")
    for tokens in batches:
        x, logits = shape.batch(tokens)
        weights, ids = route(logits, top_k, True, DTYPE)
        nbytes = ids.unique().numel() * shape.expert_bytes
        policy = pair_launch(tokens, top_k, hidden, inter)
        report(f"moe sweep T={tokens} policy", bench(lambda: pair_experts(x, gate_up, down, weights, ids, policy)),
               nbytes=nbytes, extra=f"{policy}")
        for kernel in ("gate_up", "down"):
            own = getattr(policy, kernel)
            times = []
            for t in tiles + [dataclasses.replace(own, num_warps=w, num_stages=st) for w in (2, 8) for st in (1, 2)]:
                launch = dataclasses.replace(policy, **{kernel: t})
                times.append((bench(lambda launch=launch: pair_experts(x, gate_up, down, weights, ids, launch)), t))
            for seconds, t in sorted(times, key=lambda item: item[0])[:5]:
                report(f"moe sweep T={tokens} {kernel} {t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}",
                       seconds, nbytes=nbytes, extra="the policy's" if t == own else "")
