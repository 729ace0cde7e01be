"""Paged-cache layouts for the attention kernels' benchmarks (bench kernels: the paged and the MLA kernel)."""
from __future__ import annotations

import math

import torch


def scattered_blocks(requests: list[tuple[int, int]], block_size: int
                     ) -> tuple[int, torch.Tensor, list[torch.Tensor], list[int]]:
    """requests: (cached context, new tokens). Each request's blocks drawn from a random permutation of the pool
    (block 0, the null block, unused): (blocks in the pool, block table [R, max blocks] int32, each request's slots
    of its new tokens, query start offsets)."""
    blocks_per = [math.ceil((c + n) / block_size) for c, n in requests]
    num_blocks = 1 + sum(blocks_per)
    perm = (torch.randperm(num_blocks - 1) + 1).int()
    table = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    slots, qsl, start = [], [0], 0
    for i, ((c, n), nb) in enumerate(zip(requests, blocks_per)):
        table[i, :nb] = perm[start:start + nb]
        start += nb
        pos = torch.arange(c, c + n)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
    return num_blocks, table, slots, qsl
