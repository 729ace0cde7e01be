"""Process groups of one engine instance and the collectives the model uses: NCCL on CUDA, gloo on CPU.

Until `init_distributed` runs, the tensor-parallel group is a single rank and every collective is a no-op, so
the single-rank path never touches torch.distributed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from surge.config import ParallelConfig
from surge.distributed.ranks import local_world_size, node_leader_ranks

# Start-up waits this long for every rank (other nodes may start later); collectives inside a step use it too.
_INIT_TIMEOUT = timedelta(minutes=10)
# The relay of steps to other nodes waits while the engine is idle, which may last any time.
_IDLE_TIMEOUT = timedelta(days=365)


class PeerLostError(RuntimeError):
    """A collective failed: another rank is gone (crashed, killed, or its node unreachable)."""


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None  # NCCL on CUDA, gloo on CPU: model collectives
    cpu_group: dist.ProcessGroup | None = None  # gloo: small host-side agreements

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        try:
            dist.all_reduce(x, group=self.device_group)
        except RuntimeError as e:
            raise PeerLostError(f"rank {self.rank}: all_reduce failed: {e}") from e
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenation of every rank's x along dim, on rank 0; None on the others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        chunks = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        try:
            dist.gather(x, chunks, dst=0, group=self.device_group)
        except RuntimeError as e:
            raise PeerLostError(f"rank {self.rank}: gather failed: {e}") from e
        return torch.cat(chunks, dim=dim) if chunks is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from rank src into every rank's x, in place (on the device: the host does not wait)."""
        if self.world_size == 1:
            return x
        try:
            dist.broadcast(x, src=src, group=self.device_group)
        except RuntimeError as e:
            raise PeerLostError(f"rank {self.rank}: broadcast failed: {e}") from e
        return x

    def min_int(self, value: int) -> int:
        """The smallest value over the ranks (e.g. KV blocks, so every rank allocates the same number)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_TP = TPGroup()
# The ranks that split the experts between them: the tensor-parallel ranks with enable_expert_parallel (EP size =
# TP size), else a single rank (each rank then holds a slice of every expert, split like a dense MLP).
_EP = TPGroup()
_LEADERS: dist.ProcessGroup | None = None


def get_tp_group() -> TPGroup:
    return _TP


def get_ep_group() -> TPGroup:
    return _EP


@contextlib.contextmanager
def layout_of_rank(parallel: ParallelConfig, rank: int) -> Iterator[None]:
    """Within it, the groups report `rank` of `parallel`'s ranks without any process group: for building a rank's
    model on the meta device to read its shapes (a rank's KV cache groups in the engine process). Collectives must
    not run inside."""
    global _TP, _EP
    saved = _TP, _EP
    _TP = TPGroup(rank=rank, world_size=parallel.tensor_parallel_size)
    _EP = _TP if parallel.enable_expert_parallel else TPGroup()
    try:
        yield
    finally:
        _TP, _EP = saved


def init_distributed(parallel: ParallelConfig, rank: int, device: torch.device) -> None:
    """Join the engine's process group as `rank` (a global rank, see ranks.py). Called once per worker process."""
    global _TP, _EP, _LEADERS
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{parallel.master_addr}:{parallel.master_port}",
                            world_size=parallel.tensor_parallel_size, rank=rank, timeout=_INIT_TIMEOUT)
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else world
    if parallel.nnodes > 1:  # every rank takes part in creating a group, members or not
        leaders = node_leader_ranks(parallel.nnodes, local_world_size(parallel.tensor_parallel_size,
                                                                      parallel.nnodes))
        group = dist.new_group(ranks=leaders, backend="gloo", timeout=_IDLE_TIMEOUT)
        _LEADERS = group if rank in leaders else None
    _TP = TPGroup(rank=rank, world_size=parallel.tensor_parallel_size, device_group=world, cpu_group=cpu_group)
    _EP = _TP if parallel.enable_expert_parallel else TPGroup()


def relay_bytes(data: bytes | None) -> bytes:
    """Node leaders only: global rank 0 sends data (a step), every other node's leader receives it."""
    assert _LEADERS is not None, "relay_bytes needs nnodes > 1 and a node leader"
    sender = dist.get_rank() == 0
    try:
        size = torch.tensor([len(data) if sender else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=_LEADERS)
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if sender and data
                   else torch.empty(int(size.item()), dtype=torch.uint8))
        if payload.numel():
            dist.broadcast(payload, src=0, group=_LEADERS)
    except RuntimeError as e:
        raise PeerLostError(f"rank {dist.get_rank()}: relaying a step between nodes failed: {e}") from e
    return data if sender else payload.numpy().tobytes()


def destroy_distributed() -> None:
    global _TP, _EP, _LEADERS
    _TP, _EP, _LEADERS = TPGroup(), TPGroup(), None
    if dist.is_initialized():
        dist.destroy_process_group()
