"""One engine's Mooncake transfer engine for prefill -> decode KV transfer: the KV cache tensors registered where
they lie, remote blocks read by address, and a notification to the peer when a read completes.

A KV cache in device memory that the installed Mooncake build cannot register (the -non-cuda wheel) goes through a
staging cache instead: host memory in the KV cache's own layout with fewer blocks ("slots"), where a prefill engine
copies a finished request's blocks (one copy per layer) and a decode engine receives them before copying them to
its device (in stream order, on the step's thread). Peers cannot tell: they read blocks, or slots, by address.

Mooncake's TransferEngine (TCP here and in CI, RDMA where the hardware has it) does the moving, the handshake
(P2PHANDSHAKE: peers are named host:port, no metadata server) and the notifications; Surge only says which byte
ranges go where. A peer's layout (its KV tensors' addresses and strides) is a small msgpack descriptor in one more
registered buffer, read once per peer. Reads run on the agent's own thread, off the engine step's critical path.
"""
from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import torch

from surge.kv_transfer.base import write_blocks
from surge.logger import init_logger

logger = init_logger(__name__)

_SCRATCH_BYTES = 1 << 16  # registered memory for peers' descriptors and the one-byte reads that carry a release


class LayerRegion(msgspec.Struct, array_like=True, gc=False):
    """One layer's cache, [planes, num_blocks, block_size, heads, head_dim]: where each plane starts (K and V, or an
    MLA latent's one) and a block's stride."""
    group_id: int
    kv_ptrs: tuple[int, ...]
    block_stride: int  # bytes from one block to the next (== a block's bytes: blocks are contiguous)


class EngineLayout(msgspec.Struct, array_like=True, gc=False):
    """What a peer must know to read this engine's blocks; layouts must match for the bytes to mean the same."""
    engine_id: str
    layout_digest: str  # of every transferable group's block_layout_key
    block_bytes: list[int]  # per KV cache group: one plane (K, V or an MLA latent) of one layer's block
    layers: list[LayerRegion]


def merged_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(first local block, first remote block, length) of each run where both sides' block ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    for lo, re in zip(local, remote, strict=True):
        if runs and lo == runs[-1][0] + runs[-1][2] and re == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lo, re, 1))
    return runs


class TransferAgent:
    """A TransferEngine bound to `hostname`, this engine's KV caches registered with it."""

    def __init__(self, hostname: str, engine_id: str | None = None) -> None:
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as e:
            raise RuntimeError(
                f"MooncakeTransferConnector needs Mooncake's transfer engine ({e}). Install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), and Debian's "
                "libibverbs1 ibverbs-providers librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200") from None
        self._notify_cls, self._read = TransferNotify, TransferOpcode.Read
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, tcp) returned {rc}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.engine_id = engine_id or uuid.uuid4().hex
        self._keep: list[torch.Tensor] = []  # registered host memory this agent owns
        self._scratch = self._own(_SCRATCH_BYTES)
        self._scratch_lock = threading.Lock()
        self._layouts: dict[str, EngineLayout] = {}  # peer session -> its layout
        self.staging: list[torch.Tensor] | None = None  # per layer [2, slots, block_size, heads, head_dim]
        self._free_runs: list[tuple[int, int]] = []  # free slots of the staging cache: (first, count), sorted
        self._slots_lock = threading.Lock()
        self.layout: EngineLayout | None = None
        self.layout_region: tuple[int, int] = (0, 0)  # (address, bytes) of this engine's encoded layout
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="kv-transfer", daemon=True).start()
        logger.info("KV transfer: Mooncake transfer engine %s (engine id %s)", self.session, self.engine_id)

    def _own(self, nbytes: int) -> torch.Tensor:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        self._register(buf.data_ptr(), nbytes)
        self._keep.append(buf)
        return buf

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({nbytes} bytes) returned {rc}")

    def register_kv_caches(self, kv_caches: list[torch.Tensor], group_of_layer: list[int], layout_digest: str,
                           num_groups: int, staging_bytes: int | None = None) -> None:
        """Register every layer's cache in place (or, with staging_bytes, a staging cache of that size) and publish
        the layout descriptor of what peers read."""
        self.kv_caches = kv_caches
        if staging_bytes is not None:
            kv_caches = self._make_staging(kv_caches, staging_bytes)
        layers, block_bytes = [], [0] * num_groups
        for cache, group_id in zip(kv_caches, group_of_layer, strict=True):
            if not cache.is_contiguous():
                raise ValueError("MooncakeTransferConnector needs contiguous KV cache tensors")
            size = cache.element_size()
            if staging_bytes is None:
                self._register(cache.data_ptr(), cache.numel() * size)
            block_bytes[group_id] = cache[0, 0].numel() * size
            layers.append(LayerRegion(group_id, tuple(plane.data_ptr() for plane in cache), cache.stride(1) * size))
        self.layout = EngineLayout(self.engine_id, layout_digest, block_bytes, layers)
        encoded = msgspec.msgpack.encode(self.layout)
        if len(encoded) > _SCRATCH_BYTES:
            raise ValueError(f"the KV layout descriptor ({len(encoded)} bytes) exceeds {_SCRATCH_BYTES} bytes")
        region = self._own(len(encoded))
        region.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        self.layout_region = (region.data_ptr(), len(encoded))

    def _make_staging(self, kv_caches: list[torch.Tensor], nbytes: int) -> list[torch.Tensor]:
        per_slot = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
        num_slots = nbytes // per_slot
        if num_slots < 2:
            raise ValueError(f"MooncakeTransferConnector: staging_gib={nbytes / 2**30:g} holds no block "
                             f"({per_slot} bytes with every layer); raise it")
        pin = kv_caches[0].device.type == "cuda"
        buf = torch.empty(num_slots * per_slot, dtype=torch.uint8, pin_memory=pin)
        self._register(buf.data_ptr(), buf.numel())
        self._keep.append(buf)
        self.staging, offset = [], 0
        for c in kv_caches:
            n = c[:, 0].numel() * c.element_size() * num_slots
            view = buf[offset:offset + n].view(c.dtype).view(c.shape[0], num_slots, *c.shape[2:])
            self.staging.append(view)
            offset += n
        self._free_runs = [(1, num_slots - 1)]  # slot 0 unused: id 0 means "no block" in block lists
        logger.info("KV transfer: %d staging slots (%.2f GiB of %shost memory) for a KV cache on %s", num_slots,
                    buf.numel() / 2**30, "pinned " if pin else "", kv_caches[0].device)
        return self.staging

    # ---- the staging cache ----
    def take_slots(self, n: int) -> int | None:
        """The first of n consecutive free slots (consecutive: one copy, one range per layer), or None."""
        with self._slots_lock:
            for i, (first, count) in enumerate(self._free_runs):
                if count >= n:
                    self._free_runs[i] = (first + n, count - n)
                    if count == n:
                        del self._free_runs[i]
                    return first
        return None

    def give_back_slots(self, first: int, n: int) -> None:
        with self._slots_lock:
            runs = sorted([*self._free_runs, (first, n)])
            merged = [runs[0]]
            for start, count in runs[1:]:
                if start == merged[-1][0] + merged[-1][1]:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((start, count))
            self._free_runs = merged

    def stage_out(self, block_ids: list[list[int]], group_of_layer: list[int], groups: list[int], first: int) -> None:
        """Blocks (per group) of the KV cache into slots first, first + 1, ...; complete when it returns."""
        device = self.kv_caches[0].device
        ids = {g: torch.tensor(block_ids[j], device=device) for j, g in enumerate(groups)}
        for cache, stage, g in zip(self.kv_caches, self.staging, group_of_layer, strict=True):
            if g in ids:
                stage[:, first:first + len(block_ids[groups.index(g)])].copy_(cache[:, ids[g]])
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # after this step's writes; before any peer reads

    def stage_in(self, first: int, block_ids: list[list[int]], group_of_layer: list[int],
                 groups: list[int]) -> torch.cuda.Event | None:
        """Slots first, first + 1, ... into the KV cache's blocks (per group), queued in stream order; the event
        says when the slots may be reused (None: already)."""
        device = self.kv_caches[0].device
        ids = {g: torch.tensor(block_ids[j], device=device) for j, g in enumerate(groups)}
        for cache, stage, g in zip(self.kv_caches, self.staging, group_of_layer, strict=True):
            if g in ids:
                n = len(block_ids[groups.index(g)])
                write_blocks(cache, ids[g], stage[:, first:first + n].to(device, non_blocking=True))
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # ---- the agent's thread ----
    def _serve(self) -> None:
        while True:
            future, fn = self._calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 (the caller gets it)
                    future.set_exception(e)

    def submit(self, fn: Callable) -> Future:
        future: Future = Future()
        self._calls.put((future, fn))
        return future

    # ---- reading a peer (on the agent's thread) ----
    def peer_layout(self, session: str, region: tuple[int, int]) -> EngineLayout:
        layout = self._layouts.get(session)
        if layout is None:
            addr, nbytes = region
            if not 0 < nbytes <= _SCRATCH_BYTES:
                raise ValueError(f"remote_layout size {nbytes} is outside (0, {_SCRATCH_BYTES}]")
            with self._scratch_lock:
                rc = self.engine.transfer_sync_read(session, self._scratch.data_ptr(), addr, nbytes)
                if rc != 0:
                    raise RuntimeError(f"reading the layout of {session} returned {rc}")
                layout = msgspec.msgpack.decode(self._scratch[:nbytes].numpy().tobytes(), type=EngineLayout)
            self._layouts[session] = layout
        return layout

    def read_blocks(self, session: str, region: tuple[int, int], groups: list[int], local_ids: list[list[int]],
                    remote_ids: list[list[int]], transfer_id: str) -> int:
        """Every layer's K and V of the given blocks of each group, from the peer into this engine's cache, then a
        notification carrying transfer_id to the peer (sent by Mooncake once the reads completed). Returns bytes."""
        remote = self.peer_layout(session, region)
        local = self.layout
        if remote.layout_digest != local.layout_digest or len(remote.layers) != len(local.layers):
            raise ValueError(f"the KV layout of {session} ({remote.layout_digest}) differs from this engine's "
                             f"({local.layout_digest}): another model, dtype, block size or TP split")
        mine, theirs, lengths = [], [], []
        for mine_layer, their_layer in zip(local.layers, remote.layers, strict=True):
            g = mine_layer.group_id
            if g not in groups:
                continue
            j = groups.index(g)
            for lo, re, n in merged_runs(local_ids[j], remote_ids[j]):
                for kv in range(len(mine_layer.kv_ptrs)):
                    mine.append(mine_layer.kv_ptrs[kv] + lo * mine_layer.block_stride)
                    theirs.append(their_layer.kv_ptrs[kv] + re * their_layer.block_stride)
                    lengths.append(n * local.block_bytes[g])
        if not mine:
            return 0
        rc = self.engine.batch_transfer_sync(session, mine, theirs, lengths, self._read,
                                             self._notify_cls(self.engine_id, transfer_id))
        if rc != 0:
            raise RuntimeError(f"reading {len(mine)} ranges from {session} returned {rc}")
        return sum(lengths)

    def release(self, session: str, region: tuple[int, int], transfer_id: str) -> None:
        """Tell the peer its blocks for transfer_id are not wanted: a one-byte read that carries the notification."""
        with self._scratch_lock:
            rc = self.engine.batch_transfer_sync(session, [self._scratch.data_ptr()], [region[0]], [1], self._read,
                                                 self._notify_cls(self.engine_id, transfer_id))
        if rc != 0:
            raise RuntimeError(f"releasing transfer {transfer_id} at {session} returned {rc}")

    def notifications(self) -> list[str]:
        """Transfer ids peers have finished reading (or released) since the last call."""
        return [n.msg for n in self.engine.get_notifies()]


# The engine's agent, shared by the connector's two halves when they live in one process (one rank): the worker
# half creates it with the KV caches, the scheduler half names it in the params it returns.
_AGENTS: dict[int, TransferAgent] = {}


def agent_for(key: int, hostname: str, engine_id: str | None) -> TransferAgent:
    agent = _AGENTS.get(key)
    if agent is None:
        agent = _AGENTS[key] = TransferAgent(hostname, engine_id)
    return agent


def find_agent(key: int) -> TransferAgent | None:
    return _AGENTS.get(key)
