"""The CPU offload tier: KV blocks of finished prefixes copied into a bounded host-memory pool (pinned on CUDA),
least recently used out first, and loaded back into fresh blocks on a later prefix hit. With `async_load` in
kv_connector_extra_config, loads run in the background (their own CUDA stream, or a thread on the CPU) while the
request waits and others keep running.

The scheduler half keeps the pool's index (block hash -> slot, per group which slots hold data) and decides every
copy; each worker rank holds its shard of the pool and executes the copies: loads on the compute stream before the
forward (so they cannot fail or race), saves on their own CUDA stream after it, overlapping the next steps, the
finished request's blocks held until that stream has passed them.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict

import msgspec
import torch

from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.core.kv_connector import KVConnectorOutput
from surge.core.request import Request
from surge.core.scheduler_output import SchedulerOutput
from surge.kv_transfer.base import (KVConnectorBase, KVConnectorRole, agree_across_ranks, block_index,
                                    gather_across_ranks, write_blocks)
from surge.logger import init_logger

logger = init_logger(__name__)


class BlockCopy(msgspec.Struct, array_like=True, gc=False):
    slot: int
    block_ids: list[int]  # per stored group, the GPU block; -1: nothing to copy for that group


class CopyJob(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    copies: list[BlockCopy]


class OffloadMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    loads: list[CopyJob] = []  # into the KV cache: before this step's forward, or in the background (async)
    saves: list[CopyJob] = []  # out of it, after the forward, on their own stream
    asynchronous: bool = False


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(OffloadMetadata).decode


def num_pool_slots(config: EngineConfig, kv_cache_config: KVCacheConfig, group_ids: tuple[int, ...]) -> int:
    """Slots of the pool: its bytes over one slot's (a block of every stored group's layers, rank 0's shard: the
    scheduler and every rank compute the same number)."""
    gib = config.kv_transfer_config.kv_connector_extra_config.get("cpu_gib", 4.0)
    if not (isinstance(gib, (int, float)) and gib > 0):
        raise ValueError(f"OffloadingConnector: cpu_gib={gib!r} must be a positive number of GiB")
    per_slot = sum(kv_cache_config.groups[g].spec.page_size_bytes * len(kv_cache_config.groups[g].layer_ids)
                   for g in group_ids)
    return max(1, int(gib * 2**30) // max(per_slot, 1))


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(config, role, kv_cache_config)
        self.groups = self.store_group_ids
        self.asynchronous = bool(self.extra.get("async_load", False))
        if role is KVConnectorRole.SCHEDULER:
            self.num_slots = num_pool_slots(config, kv_cache_config, self.groups)
            # block hash -> (slot, per stored group: whether the slot holds that group's block), oldest first.
            self._index: OrderedDict[bytes, tuple[int, list[bool]]] = OrderedDict()
            self._free_slots = list(range(self.num_slots - 1, -1, -1))
            self._pinned: set[int] = set()  # slots a load of this step reads: not evicted by its saves
            self._meta = OffloadMetadata([], [], self.asynchronous)
            self._saving: set[str] = set()
            self._loading: dict[str, list[int]] = {}  # asynchronous loads in flight -> the slots they read
            logger.info("KV offload tier: %d slots (%.2f GiB of host memory per rank)", self.num_slots,
                        self.extra.get("cpu_gib", 4.0))
        else:
            self._pool: dict[int, torch.Tensor] = {}
            self._pending_saves: list[tuple[str, torch.cuda.Event | None, list, float]] = []
            self._done_sending: set[str] = set()
            self._done_recving: set[str] = set()
            self._failed_recving: set[str] = set()
            self._loads_in_flight: list[tuple[str, object]] = []  # (request id, a CUDA event or a thread)
            self._load_timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # device time of loads
            self._stats = KVConnectorOutput()

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.transfer_config.loads or not self.every_group_storable:
            return 0, False
        bs = self.kv_cache_config.groups[0].spec.block_size
        start = num_computed_tokens // bs
        max_blocks = (request.num_tokens - 1) // bs  # the last prompt token is always computed
        self.stats.external_queried_tokens += max(0, max_blocks - start) * bs
        end = self._longest_hit(request.block_hashes, start, max_blocks)
        if end <= start:
            return 0, False
        for h in request.block_hashes[start:end]:
            self._index.move_to_end(h)
        return end * bs - num_computed_tokens, self.asynchronous

    def _longest_hit(self, hashes: list[bytes], start: int, max_blocks: int) -> int:
        """The largest end such that the pool holds every stored group's block at every position in [start, end).
        (A block of a sliding-window group left unloaded would still be offered to the prefix cache with the hit,
        holding stale KV: so a hit needs them all, and hybrid models' long hits mostly recompute.)"""
        end = start
        while end < min(max_blocks, len(hashes)):
            entry = self._index.get(hashes[end])
            if entry is None or not all(entry[1]):
                break
            end += 1
        return end

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        bs = self.kv_cache_config.groups[0].spec.block_size
        start = request.num_computed_tokens // bs
        self.stats.external_hit_tokens += num_external_tokens
        copies = []
        for i in range(start, start + num_external_tokens // bs):
            slot, present = self._index[request.block_hashes[i]]
            ids = [block_ids[g][i] if ok and block_ids[g][i] > 0 else -1 for g, ok in zip(self.groups, present)]
            copies.append(BlockCopy(slot, ids))
            self._pinned.add(slot)
            if self.asynchronous:  # read until the load reports back: no save may take its slot meanwhile
                self._loading.setdefault(request.request_id, []).append(slot)
        self._meta.loads.append(CopyJob(request.request_id, copies))

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save the request's complete, computed blocks the pool lacks; hold its blocks until they are copied."""
        if not self.transfer_config.saves or not self.groups:
            return False, None
        bs = self.kv_cache_config.groups[0].spec.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_hashes))
        copies = []
        for i in range(num_full):
            h = request.block_hashes[i]
            if h in self._index:
                self._index.move_to_end(h)
                continue
            ids = [block_ids[g][i] if i < len(block_ids[g]) and block_ids[g][i] > 0 else -1 for g in self.groups]
            if all(b < 0 for b in ids):
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._index[h] = (slot, [b >= 0 for b in ids])
            copies.append(BlockCopy(slot, ids))
        if not copies:
            return False, None
        self._meta.saves.append(CopyJob(request.request_id, copies))
        self._saving.add(request.request_id)
        return True, None

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        busy = self._pinned.union(*self._loading.values())
        for h, (slot, _) in self._index.items():  # least recently used first
            if slot not in busy:
                del self._index[h]
                return slot
        return None

    def build_connector_meta(self, out: SchedulerOutput) -> bytes:
        meta, self._meta = self._meta, OffloadMetadata([], [], self.asynchronous)
        self._pinned.clear()
        self.stats.pool_usage = len(self._index) / self.num_slots
        return _encode(meta) if meta.loads or meta.saves else b""

    def has_pending_work(self) -> bool:
        return bool(self._saving or self._meta.saves or self._loading)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self._saving.difference_update(output.finished_sending)
        for rid in [*output.finished_recving, *output.failed_recving]:
            self._loading.pop(rid, None)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        # This rank's shard: at least as many slots as the scheduler's count (rank 0 holds the most heads).
        num_slots = num_pool_slots(self.config, self.kv_cache_config, self.groups)
        pin = kv_caches[0].device.type == "cuda"
        for g in self.groups:
            layers = self.kv_cache_config.groups[g].layer_ids
            page = kv_caches[layers[0]][:, 0].shape  # (planes, block_size, heads, head_dim)
            # A slot is one contiguous run of every layer's block: consecutive slots cross in one copy.
            self._pool[g] = torch.zeros((num_slots, len(layers), *page), dtype=kv_caches[layers[0]].dtype,
                                        pin_memory=pin)
        self._stream = torch.cuda.Stream(kv_caches[0].device) if pin else None
        self._load_stream = torch.cuda.Stream(kv_caches[0].device) if pin else None
        logger.info("KV offload tier: %d slots, %.2f GiB of %shost memory on this rank", num_slots,
                    sum(p.numel() * p.element_size() for p in self._pool.values()) / 2**30, "pinned " if pin else "")

    def start_load_kv(self, metadata: bytes) -> None:
        self._meta_in = _decode(metadata) if metadata else None
        if self._meta_in is None or not self._meta_in.loads:
            return
        self._finish_saves(wait=True)  # a load may read a slot a save is still filling
        if not self._meta_in.asynchronous:
            for job in self._meta_in.loads:
                self._copy_in(job)
            return
        for job in self._meta_in.loads:
            if self._stream is not None:  # its own stream, after what the compute stream has queued
                self._load_stream.wait_stream(torch.cuda.current_stream(self._load_stream.device))
                with torch.cuda.stream(self._load_stream):
                    self._copy_in(job)
                event = torch.cuda.Event()
                event.record(self._load_stream)
                self._loads_in_flight.append((job.request_id, event))
            else:
                thread = threading.Thread(target=self._copy_in_background, args=(job,), daemon=True,
                                          name=f"kv-load-{job.request_id}")
                thread.start()
                self._loads_in_flight.append((job.request_id, thread))

    def _copy_in_background(self, job: CopyJob) -> None:
        try:
            self._copy_in(job)
        except Exception as e:  # a load that fails is recomputed, never served
            logger.warning("KV offload: loading request %s failed (%s); it is recomputed", job.request_id, e)
            with self._lock:
                self._failed_recving.add(job.request_id)

    def _group_copies(self, job: CopyJob):
        """Per stored group with something to copy: (its layer ids, its pool, [(slot, GPU block)])."""
        for j, g in enumerate(self.groups):
            copies = [(c.slot, c.block_ids[j]) for c in job.copies if c.block_ids[j] >= 0]
            if copies:
                yield self.kv_cache_config.groups[g].layer_ids, self._pool[g], copies

    def _copy_in(self, job: CopyJob) -> None:
        """The job's pool slots into its blocks, per stored group: a copy per run of consecutive slots from the
        (pinned) pool straight to the device, then one scatter per layer."""
        start = time.perf_counter()
        timing = None
        if self._caches[0].device.type == "cuda":  # the copies run on the device: time them there
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        nbytes = 0
        for layers, pool, copies in self._group_copies(job):
            device = self._caches[layers[0]].device
            ids = block_index([b for _, b in copies], device)
            staging = torch.empty((len(copies), *pool.shape[1:]), dtype=pool.dtype, device=device)
            for first, lo, hi in _runs([slot for slot, _ in copies]):
                staging[first:first + hi - lo].copy_(pool[lo:hi], non_blocking=True)
            for li, layer in enumerate(layers):  # [n, 2, bs, H, D] -> the cache's [2, n, bs, H, D] at ids
                write_blocks(self._caches[layer], ids, staging[:, li].transpose(0, 1))
            nbytes += staging.numel() * staging.element_size()
        with self._lock:
            self._stats.loaded_bytes += nbytes
            if timing is None:
                self._stats.load_seconds += time.perf_counter() - start
            else:
                timing[1].record()
                self._load_timings.append(timing)

    def _finish_loads(self) -> None:
        while self._load_timings and self._load_timings[0][1].query():  # device time of the loads that landed
            begin, end = self._load_timings.pop(0)
            with self._lock:
                self._stats.load_seconds += begin.elapsed_time(end) / 1e3
        still = []
        for rid, handle in self._loads_in_flight:
            done = handle.query() if isinstance(handle, torch.cuda.Event) else not handle.is_alive()
            if not done:
                still.append((rid, handle))
            elif rid not in self._failed_recving:
                self._done_recving.add(rid)
        self._loads_in_flight = still

    def save_kv(self) -> None:
        """Finished requests' blocks into their pool slots: gathered on the device, then one copy per run of
        consecutive slots straight into the (pinned) pool, on the save stream."""
        meta = self._meta_in
        if meta is None or not meta.saves:
            return
        start = time.perf_counter()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        for job in meta.saves:
            nbytes, keep = 0, []
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                for layers, pool, copies in self._group_copies(job):
                    ids = block_index([b for _, b in copies], self._caches[layers[0]].device)
                    # [layers, 2, n, bs, H, D] -> [n, layers, 2, bs, H, D]: a slot's layers side by side
                    gathered = torch.stack([self._caches[layer].index_select(1, ids) for layer in layers])
                    gathered = gathered.permute(2, 0, 1, 3, 4, 5).contiguous()
                    for first, lo, hi in _runs([slot for slot, _ in copies]):
                        pool[lo:hi].copy_(gathered[first:first + hi - lo], non_blocking=True)
                    nbytes += gathered.numel() * gathered.element_size()
                    keep.append(gathered)  # alive until the copies are done
            event = None
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
            self._pending_saves.append((job.request_id, event, (nbytes, keep), start))
        self._finish_saves(wait=False)

    def _finish_saves(self, wait: bool) -> None:
        """Saves whose copies have landed: their requests may free their blocks, loads may read their slots."""
        still = []
        for rid, event, (nbytes, keep), start in self._pending_saves:
            if event is not None and not wait and not event.query():
                still.append((rid, event, (nbytes, keep), start))
                continue
            if event is not None:
                event.synchronize()
            self._stats.saved_bytes += nbytes
            self._stats.save_seconds += time.perf_counter() - start
            self._done_sending.add(rid)
        self._pending_saves = still

    def get_finished(self) -> KVConnectorOutput:
        self._finish_saves(wait=False)
        self._finish_loads()
        sent = agree_across_ranks(self._done_sending)
        self._done_sending.difference_update(sent)
        with self._lock:
            failed = set(self._failed_recving)
        # A load is over once every rank is done with it (loaded or failed); failed if any rank failed it.
        views = gather_across_ranks((self._done_recving | failed, failed))
        over = set.intersection(*(done for done, _ in views))
        failed_anywhere = over & set.union(*(f for _, f in views))
        self._done_recving -= over
        with self._lock:
            self._failed_recving -= over
            out, self._stats = self._stats, KVConnectorOutput()
        out.finished_sending = sent
        out.finished_recving = sorted(over - failed_anywhere)
        out.failed_recving = sorted(failed_anywhere)
        return out


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in the list, first slot, end slot) of each run of consecutive slots."""
    runs, first = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((first, slots[first], slots[i - 1] + 1))
            first = i
    return runs
