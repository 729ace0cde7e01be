"""A model's tensors as a table of storages and views, the one contract for CPU and CUDA: the daemon exports every
parameter and buffer (non-persistent ones included; a tensor seen under a second name becomes an alias), the engine
opens the storages and binds the views into a model built on the meta device.

A storage crosses processes as a CUDA IPC handle, exported anew for every request so each engine holds its own
reference, or on CPU as a shared-memory file descriptor: `share_cpu_storages` moves the daemon's storages into
unlinked POSIX shared memory once (torch's file_descriptor scheme), and each request sends their descriptors
with SCM_RIGHTS. Nothing is left in /dev/shm when a process dies; the memory lives while any process maps it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from surge.weight_cache.protocol import CudaIpcHandle, StorageHandle, TensorEntry


class TableMismatchError(ValueError):
    """The daemon's table does not fit the engine's model."""


@dataclass
class TensorTable:
    """The daemon's side: the storages it holds and the views that make up the model."""
    storages: list[torch.UntypedStorage]
    tensors: list[TensorEntry]
    aliases: list[tuple[str, str]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Every (name, tensor, kind), duplicates included: `state_dict` misses non-persistent buffers (rotary
    tables), and `named_parameters()` alone drops the second name of a tied weight."""
    for name, t in model.named_parameters(remove_duplicate=False):
        yield name, t, "parameter"
    for name, t in model.named_buffers(remove_duplicate=False):
        yield name, t, "buffer"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TableMismatchError(f"unknown dtype {name!r} in the daemon's table")
    return dtype


def export_tensors(model: nn.Module) -> TensorTable:
    storages: list[torch.UntypedStorage] = []
    storage_index: dict[int, int] = {}
    tensors: list[TensorEntry] = []
    aliases: list[tuple[str, str]] = []
    first_name: dict[int, str] = {}
    for name, t, kind in named_tensors(model):
        if id(t) in first_name:
            aliases.append((name, first_name[id(t)]))
            continue
        first_name[id(t)] = name
        storage = t.untyped_storage()
        index = storage_index.setdefault(storage._cdata, len(storages))
        if index == len(storages):
            storages.append(storage)
        tensors.append(TensorEntry(name=name, kind=kind, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                   stride=list(t.stride()), storage=index, storage_offset=t.storage_offset()))
    return TensorTable(storages, tensors, aliases)


def share_cpu_storages(table: TensorTable) -> None:
    """Move CPU storages into shared memory in place (one storage at a time: the peak is the model plus one
    storage); every tensor viewing them follows."""
    for storage in table.storages:
        if storage.device.type == "cpu" and storage.nbytes():
            storage._share_fd_cpu_()


def export_handles(table: TensorTable) -> tuple[list[StorageHandle], list[int]]:
    """Handles for one request, and (CPU) the descriptors to send after the reply; the storages keep owning them."""
    handles: list[StorageHandle] = []
    fds: list[int] = []
    for storage in table.storages:
        if not storage.nbytes():
            handles.append(StorageHandle(nbytes=0))
        elif storage.device.type == "cpu":
            fd, size = storage._share_fd_cpu_()
            handles.append(StorageHandle(nbytes=size, fd_index=len(fds)))
            fds.append(fd)
        elif storage.device.type == "cuda":
            # A fresh export per request: it counts one more consumer of the allocation, which that consumer's
            # storage gives back when freed, so the daemon never frees memory an engine still maps.
            _, handle, size, offset, ref_handle, ref_offset, event_handle, sync = storage._share_cuda_()
            handles.append(StorageHandle(nbytes=size, cuda=CudaIpcHandle(
                handle=handle, offset_bytes=offset, ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                event_handle=event_handle, event_sync_required=bool(sync))))
        else:
            raise ValueError(f"storages on {storage.device} cannot be shared")
    return handles, fds


def open_storages(handles: list[StorageHandle], fds: list[int], device: torch.device) -> list[torch.UntypedStorage]:
    """The engine's side: map each storage on `device` (the caller closes `fds`; torch keeps its own duplicates)."""
    storages = []
    for i, h in enumerate(handles):
        if h.nbytes == 0:
            storages.append(torch.UntypedStorage(0, device=device))
        elif device.type == "cpu":
            if not 0 <= h.fd_index < len(fds):
                raise TableMismatchError(f"storage {i} names descriptor {h.fd_index}, but {len(fds)} arrived")
            storages.append(torch.UntypedStorage._new_shared_fd_cpu(fds[h.fd_index], h.nbytes))
        elif device.type == "cuda":
            if h.cuda is None:
                raise TableMismatchError(f"storage {i} has no CUDA IPC handle")
            c = h.cuda
            torch.cuda._lazy_init()
            # Opened on the engine's own device index (the daemon's may differ); the key matched the GPU's UUID.
            storages.append(torch.UntypedStorage._new_shared_cuda(
                device.index, c.handle, h.nbytes, c.offset_bytes, c.ref_counter_handle, c.ref_counter_offset,
                c.event_handle, c.event_sync_required))
        else:
            raise TableMismatchError(f"device {device} cannot open shared storages")
    return storages


def bind_tensors(model: nn.Module, tensors: list[TensorEntry], aliases: list[tuple[str, str]],
                 storages: list[torch.UntypedStorage]) -> None:
    """Replace every parameter and buffer of a meta-device `model` with the daemon's views (assigning `.data` fails on
    meta tensors). The table must name exactly the model's tensors, each with the model's shape and dtype."""
    expected = {name: (kind, t) for name, t, kind in named_tensors(model)}
    received = [e.name for e in tensors] + [alias for alias, _ in aliases]
    missing = sorted(set(expected) - set(received))
    extra = sorted(set(received) - set(expected))
    if missing or extra:
        raise TableMismatchError(f"the daemon's tensors do not fit this model: missing {missing[:5]}, "
                                 f"unexpected {extra[:5]}")
    objects: dict[str, torch.Tensor] = {}
    for e in tensors:
        kind, like = expected[e.name]
        dtype = parse_dtype(e.dtype)
        if e.kind != kind or dtype != like.dtype or tuple(e.shape) != tuple(like.shape):
            raise TableMismatchError(f"{e.name}: the daemon holds a {e.kind} {dtype_name(dtype)}{tuple(e.shape)}, "
                                     f"the model wants a {kind} {dtype_name(like.dtype)}{tuple(like.shape)}")
        if not 0 <= e.storage < len(storages):
            raise TableMismatchError(f"{e.name}: storage {e.storage} is not in the table")
        storage = storages[e.storage]
        try:
            t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, e.storage_offset, e.shape, e.stride)
        except RuntimeError as err:
            raise TableMismatchError(f"{e.name}: its view does not fit its storage ({err})") from None
        objects[e.name] = nn.Parameter(t, requires_grad=False) if kind == "parameter" else t
    for alias, target in aliases:
        if target not in objects:
            raise TableMismatchError(f"alias {alias} names {target}, which the table does not hold")
        objects[alias] = objects[target]
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, obj in objects.items():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        if isinstance(obj, nn.Parameter):
            module._parameters[leaf] = obj
        else:
            module._buffers[leaf] = obj
    left = [name for name, t, _ in named_tensors(model) if t.is_meta]
    left += [f"{name}.{attr}" for name, m in model.named_modules() for attr, v in vars(m).items()
             if isinstance(v, torch.Tensor) and v.is_meta]
    if left:
        raise TableMismatchError(f"tensors still on the meta device after binding: {left[:5]}")


def clone_storages(storages: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
    """copy mode: private copies on the same device, so the daemon can release its own."""
    return [s.clone() for s in storages]
