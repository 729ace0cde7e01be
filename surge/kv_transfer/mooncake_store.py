"""The Mooncake store connector: KV blocks of finished requests go into a Mooncake distributed store (shared by
engines, outliving their restarts) and come back, asynchronously, into fresh blocks on a later prefix hit.

A block's key is its chained hash plus the engine's layout (`block_layout_key`: model, dtype, TP size and rank,
block size, KV group), so an engine of another layout never reads it; only prefix-cacheable groups are stored. The
scheduler half checks existence in one batch before it takes a hit and before it saves. Each worker rank moves its
own shard through a registered (pinned on CUDA) staging buffer: the store calls run on a background thread, off the
step's critical path; the copies between that buffer and the KV cache run on the step's thread, in stream order.
A store that is down or slow costs hits, never requests: every call is bounded in time, failures are counted (a
warning the first time), a failed or partial load is recomputed, and the store is tried again after a pause.
"""
from __future__ import annotations

import dataclasses
import hashlib
import queue
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import msgspec
import torch

from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.core.kv_connector import KVConnectorOutput
from surge.core.request import Request
from surge.core.scheduler_output import SchedulerOutput
from surge.distributed.parallel_state import get_tp_group
from surge.kv_transfer.base import (KVConnectorBase, KVConnectorRole, agree_across_ranks, block_index,
                                    block_layout_key, write_blocks)
from surge.logger import init_logger

logger = init_logger(__name__)

# Mooncake's error codes (mooncake-store/include/types.h) that mean the store itself is unreachable or broken, not
# that one object is missing: after one of these the store is left alone for retry_interval_s.
_STORE_DOWN = {-1: "INTERNAL_ERROR", -103: "CLIENT_NOT_FOUND", -600: "INVALID_PARAMS (client not set up)",
               -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT"}
_OBJECT_ALREADY_EXISTS = -705  # a put that another engine (or rank) won: the block is there, which is the point
_SHORT_READ = -10  # BUFFER_OVERFLOW: a value of another size than this layout's block (never loaded)


# ---- settings ----
@dataclass(frozen=True)
class MooncakeStoreSettings:
    """`kv_connector_extra_config` of the MooncakeStoreConnector (sizes in bytes, times in seconds)."""
    master: str = "127.0.0.1:50051"  # the master's RPC address, host:port
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = "127.0.0.1"  # the address this engine's transfer engine publishes
    protocol: str = "tcp"
    # Memory this engine's client lends the store. 0: none, so blocks live in the store's own servers (`surge
    # kv-store serve`) and outlive the engine; a lent segment goes away with the engine, and its blocks with it.
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20  # the Mooncake client's own transfer buffer
    staging_buffer_size: int = 512 << 20  # per rank: registered host memory every transfer goes through
    lookup_timeout_s: float = 1.0  # a batch existence check the scheduler waits for, at most
    transfer_timeout_s: float = 10.0  # a load (recomputed then) or save (dropped) not done by then fails
    connect_timeout_s: float = 5.0
    retry_interval_s: float = 10.0  # after a failure, the store is left alone this long

    @staticmethod
    def from_extra_config(extra: dict) -> MooncakeStoreSettings:
        known = {f.name: f for f in dataclasses.fields(MooncakeStoreSettings)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"MooncakeStoreConnector: unknown kv_connector_extra_config keys {unknown}; known: "
                             f"{', '.join(known)}")
        defaults = MooncakeStoreSettings()
        for name, value in extra.items():
            default = getattr(defaults, name)
            where = f"MooncakeStoreConnector: kv_connector_extra_config[{name!r}]={value!r}"
            if isinstance(default, str) and not (isinstance(value, str) and value):
                raise ValueError(f"{where} must be a non-empty string")
            if isinstance(default, int) and not (isinstance(value, int) and not isinstance(value, bool)
                                                 and value >= 0):
                raise ValueError(f"{where} must be a whole number of bytes >= 0")
            if isinstance(default, float) and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                   and value > 0):
                raise ValueError(f"{where} must be a positive number of seconds")
        settings = dataclasses.replace(defaults, **{k: (float(v) if isinstance(getattr(defaults, k), float) else v)
                                                    for k, v in extra.items()})
        host, _, port = settings.master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"MooncakeStoreConnector: kv_connector_extra_config['master']={settings.master!r} must "
                             "be host:port, e.g. 127.0.0.1:50051")
        if settings.staging_buffer_size == 0:
            raise ValueError("MooncakeStoreConnector: kv_connector_extra_config['staging_buffer_size']=0 must hold "
                             "at least one block")
        return settings


def store_key(layout_digest: str, block_hash: bytes) -> str:
    return f"surge/{layout_digest}/{block_hash.hex()}"


def layout_digest(config: EngineConfig, kv_cache_config: KVCacheConfig, group_id: int, rank: int) -> str:
    """A short, fixed-length stand-in for block_layout_key in every key (logged once beside the full key)."""
    return hashlib.sha256(block_layout_key(config, kv_cache_config, group_id, rank).encode()).hexdigest()[:16]


# ---- the Mooncake client ----
class StoreError(RuntimeError):
    """The store is unreachable, broken or too slow: serving goes on without it for a while."""


def _probe(what: str, host: str, port: int) -> None:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError as e:
        raise StoreError(f"the {what} at {host}:{port} is not reachable ({e.strerror or e})") from None


def _serve_calls(calls: queue.SimpleQueue) -> None:
    """The client's thread: runs its calls in order; a None ends it (after closing the client)."""
    while True:
        item = calls.get()
        if item is None:
            return
        future, fn = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 (the caller gets it)
                future.set_exception(e)


def _close_client(calls: queue.SimpleQueue, state: dict) -> None:
    """When the StoreClient is collected: close its Mooncake client on its own thread, then end that thread."""
    store = state.pop("store", None)
    if store is not None:
        calls.put((Future(), store.close))
    calls.put(None)


class StoreClient:
    """One Mooncake client (MooncakeDistributedStore). Every call runs on the client's own daemon thread, so a
    caller bounds how long it waits; a failure makes the store unavailable for retry_interval_s, a call that outlives
    its caller keeps it unavailable until it returns, and then it is tried again (reconnecting if it never came up)."""

    def __init__(self, settings: MooncakeStoreSettings, name: str,
                 on_failure: Callable[[], None] | None = None) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                f"MooncakeStoreConnector needs the Mooncake store client ({e}). Install "
                "mooncake-transfer-engine-non-cuda (requirements/cpu.txt, cuda.txt) and Debian's libibverbs1 "
                "ibverbs-providers librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200 (scripts/test does)") from None
        self._store_class = MooncakeDistributedStore
        self.settings = settings
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._state: dict = {}  # "store": the connected client, shared with the finalizer
        threading.Thread(target=_serve_calls, args=(self._calls,), name=f"mooncake-{name}", daemon=True).start()
        # Not at exit: a close racing the interpreter's teardown can abort the process; the OS cleans up then.
        weakref.finalize(self, _close_client, self._calls, self._state).atexit = False
        self._buffers: list[tuple[int, int]] = []  # registered on every (re)connect
        self._connecting: Future | None = None
        self._stuck: Future | None = None  # a call its caller stopped waiting for
        self._retry_at = 0.0
        self._warned = False
        self._on_failure = on_failure
        self.num_failures = 0

    @property
    def store(self):
        return self._state.get("store")

    def submit(self, fn: Callable) -> Future:
        future: Future = Future()
        self._calls.put((future, fn))
        return future

    def register_buffer(self, ptr: int, size: int) -> None:
        """Memory the transfers read and write (zero-copy), registered on connecting: call before connect()."""
        assert self.store is None and self._connecting is None
        self._buffers.append((ptr, size))

    @staticmethod
    def _register(store, ptr: int, size: int) -> None:
        rc = store.register_buffer(ptr, size)
        if rc != 0:
            raise StoreError(f"register_buffer({size} bytes) returned {rc}")

    def connect(self, timeout: float) -> bool:
        """Set the client up, waiting at most `timeout`; False (and tried again later) if it is not up by then."""
        self._start_connect()
        try:
            self._connecting.result(timeout)
        except (FutureTimeout, Exception):  # noqa: BLE001 (ready() accounts for it)
            pass
        return self.ready()

    def _start_connect(self) -> None:
        if self._connecting is None:
            self._connecting = self.submit(self._setup)

    def _setup(self):
        """On the client's thread. A master that does not answer a TCP connect fails at once: Mooncake's own setup
        would retry for about 90 s."""
        s = self.settings
        host, _, port = s.master.rpartition(":")
        _probe("master", host, int(port))
        url = urllib.parse.urlsplit(s.metadata_server)
        if url.scheme == "http" and url.hostname:
            _probe("metadata server", url.hostname, url.port or 80)
        store = self._store_class()
        rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size, s.protocol,
                         "", s.master)
        if rc != 0:
            raise StoreError(f"setup with master {s.master}, metadata {s.metadata_server} returned {rc}")
        for ptr, size in self._buffers:
            self._register(store, ptr, size)
        return store

    def ready(self) -> bool:
        """True when a call may be made now: connected, no call stuck, not in a pause after a failure."""
        if self._connecting is not None:
            if not self._connecting.done():
                return False
            future, self._connecting = self._connecting, None
            if future.exception() is not None:
                self.fail(f"cannot connect: {future.exception()}")
            else:
                self._state["store"] = future.result()
                logger.info("Mooncake store (%s): connected to master %s", self.name, self.settings.master)
        if self._stuck is not None:
            if not self._stuck.done():
                return False
            self._stuck = None
        if time.monotonic() < self._retry_at:
            return False
        if self.store is None:
            self._start_connect()  # answered by a later call
            return False
        return True

    def fail(self, reason: str) -> None:
        self.num_failures += 1
        if self._on_failure is not None:
            self._on_failure()
        self._retry_at = time.monotonic() + self.settings.retry_interval_s
        if not self._warned:
            self._warned = True
            logger.warning("Mooncake store (%s) unavailable: %s. Serving goes on without it (no hits, no saves); "
                           "trying again every %.0f s", self.name, reason, self.settings.retry_interval_s)
        else:
            logger.debug("Mooncake store (%s) unavailable: %s", self.name, reason)

    def close(self, timeout: float) -> None:
        store = self._state.pop("store", None)
        if store is not None:
            try:
                self.submit(store.close).result(timeout)
            except (FutureTimeout, Exception):  # noqa: BLE001 (closing a broken client is best effort)
                pass

    def stuck(self, future: Future) -> None:
        """The caller gave up on this call: nothing new goes to the store until it returns."""
        self._stuck = future

    def call(self, fn: Callable, timeout: float):
        """Run fn on the client's thread and wait for it at most `timeout`. None when the store cannot answer: not
        connected or paused after a failure (skipped), or the call failed or was too slow (a failure)."""
        if not self.ready():
            return None
        future = self.submit(fn)
        try:
            return future.result(timeout)
        except FutureTimeout:
            self.stuck(future)
            self.fail(f"no answer in {timeout:g} s")
        except Exception as e:  # noqa: BLE001 (whatever the client raised, the store is what failed)
            self.fail(f"{type(e).__name__}: {e}")
        return None

    def exists(self, keys: list[str]) -> list[bool] | None:
        """Which keys the store holds, in one batch; None when it cannot say."""
        codes = self.call(lambda: self.store.batch_is_exist(keys), self.settings.lookup_timeout_s)
        if codes is None:
            return None
        bad = [c for c in codes if c < 0]
        if bad or len(codes) != len(keys):
            self.fail(f"batch_is_exist: {_STORE_DOWN.get(bad[0], bad[0]) if bad else 'wrong number of results'}")
            return None
        return [c == 1 for c in codes]


# ---- what the scheduler half tells the worker half ----
class BlockTransfer(msgspec.Struct, array_like=True, gc=False):
    block_hash: bytes
    block_ids: list[int]  # per stored group, the KV cache block; -1: nothing to move for that group


class TransferJob(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    blocks: list[BlockTransfer]


class MooncakeMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    loads: list[TransferJob] = []
    saves: list[TransferJob] = []


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(MooncakeMetadata).decode


# ---- the worker half's bookkeeping ----
@dataclass
class _Job:
    request_id: str
    is_load: bool
    chunks: list[list[tuple[str, int, int]]]  # not started yet: (key, group, block id) per slot, group-major
    deadline: float
    in_flight: int = 0
    done: bool = False
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Chunk:
    job: _Job
    items: list[tuple[str, int, int]]
    first_slot: int
    future: Future | None = None
    event: torch.cuda.Event | None = None  # CUDA, saves: the copy into staging that the put waits for


@dataclass
class _Slots:
    """The staging buffer's slots (one block of one group each), taken as contiguous runs."""
    num_slots: int
    free: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = [True] * self.num_slots

    def take(self, n: int) -> int | None:
        run = 0
        for i, is_free in enumerate(self.free):
            run = run + 1 if is_free else 0
            if run == n:
                start = i - n + 1
                self.free[start:i + 1] = [False] * n
                return start
        return None

    def give_back(self, start: int, n: int) -> None:
        self.free[start:start + n] = [True] * n


class MooncakeStoreConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(config, role, kv_cache_config)
        self.settings = MooncakeStoreSettings.from_extra_config(self.extra)
        self.groups = self.store_group_ids
        self.block_size = kv_cache_config.groups[0].spec.block_size
        self.rank = get_tp_group().rank if role is KVConnectorRole.WORKER else 0
        # The scheduler's keys are rank 0's (it checks those; a rank whose shard is missing fails the load).
        self._digests = {g: layout_digest(config, kv_cache_config, g, self.rank) for g in self.groups}
        for g, digest in self._digests.items():
            logger.debug("Mooncake store keys surge/%s/<block hash>: %s", digest,
                         block_layout_key(config, kv_cache_config, g, self.rank))
        # The scheduler's store failures count here; a worker's reach the scheduler as failed loads and saves.
        scheduler = role is KVConnectorRole.SCHEDULER
        self.client = StoreClient(self.settings, "scheduler" if scheduler else f"rank {self.rank}",
                                  self._count_failure if scheduler else None)
        if role is KVConnectorRole.SCHEDULER:
            self._meta = MooncakeMetadata([], [])
            self._lookups: dict[str, tuple[int, int]] = {}  # request id -> (first block asked, end of the hit)
            self._saving: set[str] = set()
            if not self.every_group_storable:
                logger.warning("Mooncake store: KV group(s) %s cannot be stored (not prefix-cacheable), and a hit "
                               "would need them: this engine neither loads nor saves",
                               sorted(set(range(len(kv_cache_config.groups))) - set(self.groups)))
            self.client.connect(self.settings.connect_timeout_s)
        else:
            self._jobs: list[_Job] = []  # in arrival order: their chunks start in that order
            self._in_flight: list[_Chunk] = []
            self._releasing: list[tuple[torch.cuda.Event, int, int]] = []  # CUDA: slots an H2D copy still reads
            self._done_loads: dict[str, bool] = {}  # request id -> ok, until every rank agrees
            self._done_saves: dict[str, bool] = {}
            self._report = KVConnectorOutput()

    def _count_failure(self) -> None:
        self.stats.failures += 1

    def _key(self, group_id: int, block_hash: bytes) -> str:
        return store_key(self._digests[group_id], block_hash)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.transfer_config.loads or not self.groups or not self.every_group_storable:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        max_end = min((request.num_tokens - 1) // bs, len(request.block_hashes))  # the last token is computed
        if max_end <= start:
            return 0, False
        cached = self._lookups.get(request.request_id)  # a request that waits for blocks asks every step
        if cached is not None and cached[0] == start:
            end = cached[1]
        else:
            end = self._stored_run(request.block_hashes, start, max_end)
            self._lookups[request.request_id] = (start, end)
            self.stats.external_queried_tokens += (max_end - start) * bs
        if end <= start:
            return 0, False
        return end * bs - num_computed_tokens, True

    def _stored_run(self, hashes: list[bytes], start: int, max_end: int) -> int:
        """The end of the run of blocks from `start` that the store holds for every stored group. A sliding-window
        group counts too, inside its window or not: every block the request gets is then loaded, none left stale."""
        n = len(self.groups)
        present = self.client.exists([self._key(g, h) for h in hashes[start:max_end] for g in self.groups])
        if present is None:
            return start
        end = start
        while end < max_end and all(present[(end - start) * n:(end - start + 1) * n]):
            end += 1
        return end

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        self._lookups.pop(request.request_id, None)
        if not num_external_tokens:
            return
        start = request.num_computed_tokens // self.block_size
        blocks = [BlockTransfer(request.block_hashes[i], [block_ids[g][i] if block_ids[g][i] > 0 else -1
                                                          for g in self.groups])
                  for i in range(start, start + num_external_tokens // self.block_size)]
        self._meta.loads.append(TransferJob(request.request_id, blocks))
        self.stats.external_hit_tokens += num_external_tokens

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save the request's complete, computed blocks the store lacks; hold them until every rank's put is done."""
        self._lookups.pop(request.request_id, None)
        if not self.transfer_config.saves or not self.groups or not self.every_group_storable:
            return False, None  # without every group's blocks, no engine of this layout could use them
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        candidates = []
        for i in range(num_full):
            ids = [block_ids[g][i] if i < len(block_ids[g]) and block_ids[g][i] > 0 else -1 for g in self.groups]
            if any(b >= 0 for b in ids):
                candidates.append((request.block_hashes[i], ids))
        if not candidates:
            return False, None
        present = self.client.exists([self._key(g, h) for h, _ in candidates for g in self.groups])
        if present is None:
            return False, None
        n = len(self.groups)
        blocks = []
        for j, (h, ids) in enumerate(candidates):
            ids = [-1 if present[j * n + k] else b for k, b in enumerate(ids)]
            if any(b >= 0 for b in ids):
                blocks.append(BlockTransfer(h, ids))
        if not blocks:
            return False, None
        self._meta.saves.append(TransferJob(request.request_id, blocks))
        self._saving.add(request.request_id)
        return True, None

    def build_connector_meta(self, out: SchedulerOutput) -> bytes:
        meta, self._meta = self._meta, MooncakeMetadata([], [])
        return _encode(meta) if meta.loads or meta.saves else b""

    def has_pending_work(self) -> bool:
        return bool(self._saving or self._meta.loads or self._meta.saves)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self._saving.difference_update(output.finished_sending)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = kv_caches
        self._pin = kv_caches[0].device.type == "cuda"
        # One slot holds one block of one group: all its layers, [layers, planes, block_size, heads, head_dim].
        self._group_shape, self._group_bytes = {}, {}
        for g in self.groups:
            layers = self.kv_cache_config.groups[g].layer_ids
            page = kv_caches[layers[0]][:, 0]
            self._group_shape[g] = (len(layers), *page.shape)
            self._group_bytes[g] = len(layers) * page.numel() * page.element_size()
        self._slot_bytes = max(self._group_bytes.values(), default=1)
        num_slots = self.settings.staging_buffer_size // self._slot_bytes
        if num_slots < 1:
            raise ValueError(f"MooncakeStoreConnector: staging_buffer_size={self.settings.staging_buffer_size} holds "
                             f"no block ({self._slot_bytes} bytes with every layer); raise it")
        self._slots = _Slots(num_slots)
        self._staging = torch.empty(num_slots * self._slot_bytes, dtype=torch.uint8, pin_memory=self._pin)
        self.client.register_buffer(self._staging.data_ptr(), self._staging.numel())
        self.client.connect(self.settings.connect_timeout_s)
        logger.info("Mooncake store: %d staging slots of %.2f MiB (%s host memory) on rank %d", num_slots,
                    self._slot_bytes / 2**20, "pinned" if self._pin else "plain", self.rank)

    def _staged(self, group_id: int, first_slot: int, n: int) -> torch.Tensor:
        """Slots [first_slot, first_slot + n) as one group's blocks: [n, layers, planes, block_size, heads, head_dim]."""
        rows = self._staging[first_slot * self._slot_bytes:(first_slot + n) * self._slot_bytes]
        rows = rows.view(n, self._slot_bytes)[:, :self._group_bytes[group_id]]
        layer = self._caches[self.kv_cache_config.groups[group_id].layer_ids[0]]
        return rows.view(layer.dtype).unflatten(1, self._group_shape[group_id])

    def start_load_kv(self, metadata: bytes) -> None:
        if metadata:
            meta = _decode(metadata)
            for job in meta.loads:
                self._add_job(job, is_load=True)
            for job in meta.saves:
                self._add_job(job, is_load=False)
        self._pump()

    def _add_job(self, job: TransferJob, is_load: bool) -> None:
        items = [(self._key(g, b.block_hash), g, block_id) for b in job.blocks
                 for g, block_id in zip(self.groups, b.block_ids, strict=True) if block_id >= 0]
        items.sort(key=lambda item: item[1])  # group-major: each group's blocks are one run of slots
        chunk = self._slots.num_slots
        state = _Job(job.request_id, is_load, [items[i:i + chunk] for i in range(0, len(items), chunk)],
                     time.monotonic() + self.settings.transfer_timeout_s)
        if not items or not self.client.ready():
            self._finish(state, ok=not items)  # nothing to move is done; a store that is down fails it
            return
        self._jobs.append(state)

    def _pump(self) -> None:
        """Take in finished store calls, expire overdue jobs, start chunks while staging slots are free."""
        for chunk in [c for c in self._in_flight if c.future.done()]:
            self._in_flight.remove(chunk)
            self._chunk_done(chunk)
        still = []
        for event, first, n in self._releasing:
            if event.query():
                self._slots.give_back(first, n)
            else:
                still.append((event, first, n))
        self._releasing = still
        now = time.monotonic()
        for job in self._jobs:
            if not job.done and now > job.deadline:
                for chunk in self._in_flight:
                    if chunk.job is job:
                        self.client.stuck(chunk.future)
                self.client.fail(f"a {'load' if job.is_load else 'save'} took over "
                                 f"{self.settings.transfer_timeout_s:g} s")
                self._finish(job, ok=False)
        self._jobs = [j for j in self._jobs if not j.done]
        for job in self._jobs:
            while job.chunks:
                items = job.chunks[0]
                first = self._slots.take(len(items))
                if first is None:
                    return  # in order: later jobs wait for this one's slots
                job.chunks.pop(0)
                self._start_chunk(_Chunk(job, items, first))

    def _group_runs(self, chunk: _Chunk):
        """(group, first slot, block ids) for each group's run of slots in the chunk."""
        runs = []
        for offset, (_, g, block_id) in enumerate(chunk.items):
            if runs and runs[-1][0] == g:
                runs[-1][2].append(block_id)
            else:
                runs.append((g, chunk.first_slot + offset, [block_id]))
        return runs

    def _start_chunk(self, chunk: _Chunk) -> None:
        job = chunk.job
        keys = [key for key, _, _ in chunk.items]
        base = self._staging.data_ptr()
        ptrs = [base + (chunk.first_slot + i) * self._slot_bytes for i in range(len(keys))]
        sizes = [self._group_bytes[g] for _, g, _ in chunk.items]
        if job.is_load:
            chunk.future = self.client.submit(lambda: self._timed(self._get_into, keys, ptrs, sizes))
        else:
            start = time.perf_counter()
            for g, first, block_ids in self._group_runs(chunk):
                layers = self.kv_cache_config.groups[g].layer_ids
                ids = block_index(block_ids, self._caches[layers[0]].device)
                gathered = torch.stack([self._caches[layer].index_select(1, ids) for layer in layers])
                self._staged(g, first, len(block_ids)).copy_(gathered.permute(2, 0, 1, 3, 4, 5), non_blocking=True)
            if self._pin:
                chunk.event = torch.cuda.Event()
                chunk.event.record()
            job.seconds += time.perf_counter() - start
            event = chunk.event
            chunk.future = self.client.submit(lambda: self._timed(self._put_from, keys, ptrs, sizes, event))
        job.in_flight += 1
        self._in_flight.append(chunk)

    @staticmethod
    def _timed(fn: Callable, *args) -> tuple[list[int], float]:
        start = time.perf_counter()
        return fn(*args), time.perf_counter() - start

    # The store calls, on the client's thread (a test slows them down by overriding them).
    def _get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        codes = self.client.store.batch_get_into(keys, ptrs, sizes)  # bytes read, or an error code
        return [0 if c == size else (c if c < 0 else _SHORT_READ) for c, size in zip(codes, sizes, strict=True)]

    def _put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], event) -> list[int]:
        if event is not None:
            event.synchronize()
        codes = self.client.store.batch_put_from(keys, ptrs, sizes)
        return [0 if c == _OBJECT_ALREADY_EXISTS else c for c in codes]

    def _chunk_done(self, chunk: _Chunk) -> None:
        job = chunk.job
        job.in_flight -= 1
        n = len(chunk.items)
        try:
            codes, seconds = chunk.future.result()
        except Exception as e:  # noqa: BLE001 (a client error: the store is treated as down)
            codes, seconds = None, 0.0
            self.client.fail(f"{'get' if job.is_load else 'put'} raised {type(e).__name__}: {e}")
        job.seconds += seconds
        if job.done:  # expired while this call ran: its blocks may already belong to another request
            self._slots.give_back(chunk.first_slot, n)
            return
        bad = [c for c in codes if c != 0] if codes is not None else [None]
        if bad:
            if bad[0] in _STORE_DOWN:
                self.client.fail(f"{'batch_get_into' if job.is_load else 'batch_put_from'}: {_STORE_DOWN[bad[0]]}")
            self._slots.give_back(chunk.first_slot, n)
            self._finish(job, ok=False)
            return
        if job.is_load:
            start = time.perf_counter()
            for g, first, block_ids in self._group_runs(chunk):
                layers = self.kv_cache_config.groups[g].layer_ids
                device = self._caches[layers[0]].device
                ids = block_index(block_ids, device)
                staged = self._staged(g, first, len(block_ids))
                src = staged.to(device, non_blocking=True) if self._pin else staged
                for li, layer in enumerate(layers):
                    write_blocks(self._caches[layer], ids, src[:, li].transpose(0, 1))
            job.seconds += time.perf_counter() - start
            if self._pin:  # the slots are free once the host-to-device copy has read them
                event = torch.cuda.Event()
                event.record()
                self._releasing.append((event, chunk.first_slot, n))
            else:
                self._slots.give_back(chunk.first_slot, n)
        else:
            self._slots.give_back(chunk.first_slot, n)
        job.num_bytes += sum(self._group_bytes[g] for _, g, _ in chunk.items)
        if not job.chunks and not job.in_flight:
            self._finish(job, ok=True)

    def _finish(self, job: _Job, ok: bool) -> None:
        job.done, job.chunks = True, []
        (self._done_loads if job.is_load else self._done_saves)[job.request_id] = ok
        if not ok:
            return
        if job.is_load:
            self._report.loaded_bytes += job.num_bytes
            self._report.load_seconds += job.seconds
        else:
            self._report.saved_bytes += job.num_bytes
            self._report.save_seconds += job.seconds

    def save_kv(self) -> None:
        pass  # saves start in start_load_kv: they read blocks their finished request holds, whenever they run

    def get_finished(self) -> KVConnectorOutput:
        """Jobs done on every rank: a load is finished if it succeeded everywhere, failed otherwise; a save ends
        either way (failed: counted, its blocks freed all the same)."""
        self._pump()
        done = ({f"l{r}" for r in self._done_loads} | {f"L{r}" for r, ok in self._done_loads.items() if ok}
                | {f"s{r}" for r in self._done_saves} | {f"S{r}" for r, ok in self._done_saves.items() if ok})
        agreed = set(agree_across_ranks(done))
        out, self._report = self._report, KVConnectorOutput()
        for rid in [r for r in self._done_loads if f"l{r}" in agreed]:
            del self._done_loads[rid]
            (out.finished_recving if f"L{rid}" in agreed else out.failed_recving).append(rid)
        for rid in [r for r in self._done_saves if f"s{r}" in agreed]:
            del self._done_saves[rid]
            out.finished_sending.append(rid)
            if f"S{rid}" not in agreed:
                out.failed_sending.append(rid)
        return out

    def shutdown(self) -> None:
        """Let puts in flight land (bounded), then close the client."""
        if self.role is KVConnectorRole.WORKER:
            deadline = time.monotonic() + self.settings.transfer_timeout_s
            while self._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
                self._pump()
        self.client.close(self.settings.connect_timeout_s)
