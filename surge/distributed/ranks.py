"""Where a rank lives: the one mapping between (node_rank, local_rank) and the global rank, and its inverse.

global_rank = node_rank * local_world_size + local_rank. The executor, the workers and the weight cache all ask
here, so "which shard is mine" has one answer everywhere.
"""
from __future__ import annotations


def local_world_size(world_size: int, nnodes: int) -> int:
    """Ranks per node; every node runs the same number."""
    if nnodes < 1 or world_size < 1:
        raise ValueError(f"world_size={world_size} and nnodes={nnodes} must be positive")
    if world_size % nnodes:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide evenly across nnodes={nnodes}; "
                         f"use a multiple of {nnodes}")
    return world_size // nnodes


def global_rank(node_rank: int, local_rank: int, local_world_size: int) -> int:
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank={local_rank} must be in [0, {local_world_size})")
    if node_rank < 0:
        raise ValueError(f"node_rank={node_rank} must be >= 0")
    return node_rank * local_world_size + local_rank


def node_and_local_rank(rank: int, local_world_size: int) -> tuple[int, int]:
    """The inverse of global_rank: (node_rank, local_rank)."""
    if rank < 0:
        raise ValueError(f"rank={rank} must be >= 0")
    return divmod(rank, local_world_size)


def node_ranks(node_rank: int, local_world_size: int) -> range:
    """The global ranks that run on one node, in local-rank order."""
    return range(global_rank(node_rank, 0, local_world_size), global_rank(node_rank, 0, local_world_size)
                 + local_world_size)


def node_leader_ranks(nnodes: int, local_world_size: int) -> list[int]:
    """Local rank 0 of every node: the ranks that relay each step from node 0 to their node."""
    return [global_rank(n, 0, local_world_size) for n in range(nnodes)]
