"""The KV connector API: one class, instantiated twice. The scheduler's instance decides what to load and save
(and says so in the step message); each worker rank's instance moves the bytes and reports what finished.

A connector selects KV cache groups by declared capability (`groups_for_store`: prefix-cacheable ones; a
prefill->decode transfer would take transferable ones), never by class name: transferable is not storable.
"""
from __future__ import annotations

import enum
import threading

import torch

from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.core.kv_connector import KVConnectorOutput
from surge.core.request import Request
from surge.core.scheduler_output import SchedulerOutput
from surge.distributed.parallel_state import get_tp_group
from surge.logger import init_logger

logger = init_logger(__name__)


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorStats:
    """Counters of one instance (the scheduler's: hits; the worker results it was told: bytes, seconds, failures)."""

    def __init__(self) -> None:
        self.external_hit_tokens = 0  # prompt tokens the connector supplied
        self.external_queried_tokens = 0  # prompt tokens it was asked about
        self.loaded_bytes = 0
        self.saved_bytes = 0
        self.load_seconds = 0.0
        self.save_seconds = 0.0
        self.failures = 0  # loads that failed or came back partial (their tokens were recomputed), store errors
        self.pool_usage = 0.0  # share of the connector's own storage in use, 0..1 (where it knows)

    def add(self, output: KVConnectorOutput) -> None:
        self.loaded_bytes += output.loaded_bytes
        self.saved_bytes += output.saved_bytes
        self.load_seconds += output.load_seconds
        self.save_seconds += output.save_seconds
        self.failures += len(output.failed_recving) + len(output.failed_sending)


class KVConnectorBase:
    """Both halves. Scheduler side: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
    request_finished, has_pending_work, update_connector_output. Worker side: register_kv_caches, start_load_kv
    (before the forward; a synchronous load is complete, in stream order, when it returns), save_kv (after the
    forward) and get_finished. Defaults do nothing, so a connector implements only what it uses."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.role = role
        self.kv_cache_config = kv_cache_config  # this rank's groups (the scheduler's: rank 0's)
        self.transfer_config = config.kv_transfer_config
        self.extra = dict(self.transfer_config.kv_connector_extra_config)
        self.stats = KVConnectorStats()
        self._lock = threading.Lock()

    # ---- capabilities ----
    @property
    def store_group_ids(self) -> tuple[int, ...]:
        """The groups a prefix store keeps: prefix-cacheable ones (transferable is not storable)."""
        return self.kv_cache_config.prefix_cacheable_group_ids

    @property
    def every_group_storable(self) -> bool:
        """A hit must supply every group's KV: with a group the store cannot keep, no hit is taken."""
        return len(self.store_group_ids) == len(self.kv_cache_config.groups)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, out: SchedulerOutput) -> bytes:
        return b""

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return False, None

    def has_pending_work(self) -> bool:
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.stats.add(output)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One tensor per layer, in the attention backend's layout; layer ids index kv_cache_config's groups."""

    def start_load_kv(self, metadata: bytes) -> None:
        pass

    def save_kv(self) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput:
        return KVConnectorOutput()

    def shutdown(self) -> None:
        pass


def block_layout_key(config: EngineConfig, kv_cache_config: KVCacheConfig, group_id: int, rank: int) -> str:
    """What makes two engines' blocks interchangeable: model, dtype, TP size and rank, block size, the group's
    spec's layout id (kind, heads, head size, window; an MLA latent's split). Engines whose keys differ never read
    each other's blocks."""
    mc, pc = config.model_config, config.parallel_config
    spec = kv_cache_config.groups[group_id].spec
    return (f"{mc.model}|{mc.architecture}|{str(spec.dtype).removeprefix('torch.')}|tp{pc.tensor_parallel_size}"
            f".{rank}|bs{spec.block_size}|g{group_id}:{spec.layout_id}")


def write_blocks(cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """cache[:, block_ids] = blocks (a layer's [planes, num_blocks, ...] cache): on raw bytes for a float8 cache, whose
    dtype CPU index_copy_ has no kernel for."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache, blocks = cache.view(torch.uint8), blocks.view(torch.uint8)
    cache.index_copy_(1, block_ids, blocks)


def gather_across_ranks(value: object) -> list[object]:
    """Every tensor-parallel rank's value (small host objects: sets of request ids), on every rank."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return [value]
    import torch.distributed as dist

    gathered: list[object] = [None] * tp.world_size
    dist.all_gather_object(gathered, value, group=tp.cpu_group)
    return gathered


def agree_across_ranks(done: set[str]) -> list[str]:
    """The ids every tensor-parallel rank has in `done` (a load or save is finished once it is on all ranks)."""
    return sorted(set.intersection(*gather_across_ranks(done)))


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on the caches' device, without the host waiting: `torch.tensor(ids,
    device=cuda)` copies from pageable memory and synchronizes the stream, which stalled the host behind every
    KV copy queued before it (a 600 MB load, or the whole forward for a save)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids
