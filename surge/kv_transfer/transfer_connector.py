"""Prefill -> decode KV transfer (disaggregated serving) over Mooncake's transfer engine.

The prefill instance (kv_producer) runs a request sent with kv_transfer_params {"do_remote_decode": true} (and
max_tokens=1), keeps its blocks when it finishes, and returns kv_transfer_params: its engine id, its transfer
engine's address, the block ids of every transferable group, the prompt length and an explicit transfer id (the
caller's, e.g. the proxy's, or a fresh one: never derived from the request id, which each server salts). The decode
instance (kv_consumer), given those params, reads the blocks straight from the prefill instance's KV cache into its
own while other requests decode (an asynchronous load), then computes only what the transfer cannot supply: the
last prompt token, whose logits give the first output token (the scheduler always computes it). The prefill side
frees the blocks when the decode side's read completes (a Mooncake notification) or when `timeout_s` has passed
since it finished (freed and counted as a failure, never leaked). The params carry that moment as wall-clock time
(hosts are assumed synchronized, as NTP keeps them): the decode side does not read expired params and fails (and
recomputes) a read that ends after it, so it never keeps bytes from blocks that may have been reused.

One rank per instance for now (tensor_parallel_size=1): the scheduler half names the worker half's transfer engine.
"""
from __future__ import annotations

import array
import hashlib
import time
import uuid
from dataclasses import dataclass

import msgspec
import torch

from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.core.kv_connector import KVConnectorOutput
from surge.core.request import Request
from surge.core.scheduler_output import SchedulerOutput
from surge.kv_transfer.base import KVConnectorBase, KVConnectorRole, block_layout_key
from surge.kv_transfer.transfer_agent import agent_for, find_agent
from surge.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class TransferSettings:
    """`kv_connector_extra_config` of the MooncakeTransferConnector."""
    hostname: str = "127.0.0.1"  # the address this engine's transfer engine publishes
    timeout_s: float = 30.0  # prefill side: a finished request's blocks are freed by then if nobody read them
    engine_id: str | None = None  # default: a fresh one per engine
    # Through a host staging cache of this size (per engine) instead of the KV cache itself: None, when the KV
    # cache is not in host memory (the -non-cuda Mooncake build cannot register device memory).
    staging: bool | None = None
    staging_gib: float = 4.0

    @staticmethod
    def from_extra_config(extra: dict) -> TransferSettings:
        known = ("hostname", "timeout_s", "engine_id", "staging", "staging_gib")
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"MooncakeTransferConnector: unknown kv_connector_extra_config keys {unknown}; known: "
                             f"{', '.join(known)}")
        s = TransferSettings(**extra)
        if s.staging not in (None, True, False):
            raise ValueError(f"MooncakeTransferConnector: kv_connector_extra_config['staging']={s.staging!r} must "
                             "be true, false or null (automatic)")
        if isinstance(s.staging_gib, bool) or not (isinstance(s.staging_gib, (int, float)) and s.staging_gib > 0):
            raise ValueError(f"MooncakeTransferConnector: kv_connector_extra_config['staging_gib']="
                             f"{s.staging_gib!r} must be a positive number of GiB")
        if not (isinstance(s.hostname, str) and s.hostname):
            raise ValueError(f"MooncakeTransferConnector: kv_connector_extra_config['hostname']={s.hostname!r} "
                             "must be a host name or IP address")
        if isinstance(s.timeout_s, bool) or not (isinstance(s.timeout_s, (int, float)) and s.timeout_s > 0):
            raise ValueError(f"MooncakeTransferConnector: kv_connector_extra_config['timeout_s']={s.timeout_s!r} "
                             "(--kv-transfer-timeout) must be a positive number of seconds")
        return s


# ---- what the scheduler half tells the worker half ----
class RemoteRead(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    transfer_id: str
    session: str
    layout_region: tuple[int, int]
    local_block_ids: list[list[int]]  # per transferable group
    remote_block_ids: list[list[int]]
    expires_at: float  # time.time() when the prefill side frees the blocks: a read that ends later is failed


class Hold(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    transfer_id: str
    timeout_s: float
    slots: tuple[int, int] = (0, 0)  # (first, count) of the staging slots its blocks were copied to


class TransferMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    reads: list[RemoteRead] = []
    holds: list[Hold] = []


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(TransferMetadata).decode


def layout_digest(config: EngineConfig, kv_cache_config: KVCacheConfig) -> str:
    """Of every transferable group's layout key: engines whose digests differ never read each other's blocks."""
    keys = [block_layout_key(config, kv_cache_config, g, rank=0) for g in kv_cache_config.transferable_group_ids]
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]


def prompt_digest(token_ids: list[int]) -> str:
    """Of the prompt whose KV is sent: the decode side reads it only for a request with the very same prompt."""
    return hashlib.sha256(array.array("q", token_ids).tobytes()).hexdigest()[:32]


def _block_lists(value, num_groups: int) -> list[list[int]] | None:
    if not (isinstance(value, list) and len(value) == num_groups):
        return None
    if not all(isinstance(ids, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in ids)
               for ids in value):
        return None
    return value


class MooncakeTransferConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(config, role, kv_cache_config)
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(f"MooncakeTransferConnector: tensor_parallel_size="
                             f"{config.parallel_config.tensor_parallel_size} is not supported yet; use 1")
        self.settings = TransferSettings.from_extra_config(self.extra)
        self.groups = kv_cache_config.transferable_group_ids
        self.block_size = kv_cache_config.groups[0].spec.block_size
        self.digest = layout_digest(config, kv_cache_config)
        self.kv_cache_dtype = str(kv_cache_config.groups[0].spec.dtype).removeprefix("torch.")  # named in refusals
        self._key = id(config.kv_transfer_config)  # both halves of one engine share its config object
        self._group_of_layer = [kv_cache_config.group_of_layer(i).group_id
                                for i in range(sum(len(g.layer_ids) for g in kv_cache_config.groups))]
        if role is KVConnectorRole.SCHEDULER:
            self._meta = TransferMetadata([], [])
            self._read: set[str] = set()  # requests whose remote KV was asked for (never twice: a preempted one
            self._warned = False          # recomputes, the prefill side may have freed it)
            self._held: dict[str, str] = {}  # request id -> transfer id, while its blocks wait for the decode side
        else:
            self._holds: dict[str, Hold] = {}  # transfer id -> the hold
            self._expiry: dict[str, float] = {}  # transfer id -> when its blocks are freed anyway
            self._early: dict[str, float] = {}  # notifications that came before their hold: transfer id -> time
            self._reads: list[tuple[RemoteRead, object, int | None]] = []  # (the read, its future, first slot)
            self._releasing: list[tuple[object, int, int]] = []  # staging slots a copy to the device still reads
            self._report = KVConnectorOutput()

    @property
    def agent(self):
        agent = find_agent(self._key)
        if agent is None:
            raise RuntimeError("MooncakeTransferConnector: the worker half has not started its transfer engine")
        return agent

    # ---- scheduler side: decode ----
    def _remote(self, request: Request) -> dict | None:
        """The prefill instance's params of a request the decode side should read, if usable."""
        params = request.params.kv_transfer_params
        if not self.transfer_config.loads or not params or not params.get("do_remote_prefill"):
            return None
        if request.request_id in self._read:
            return None
        problem = None
        if params.get("remote_kv_cache_dtype", self.kv_cache_dtype) != self.kv_cache_dtype:
            problem = (f"its KV cache dtype {params.get('remote_kv_cache_dtype')!r} differs from this engine's "
                       f"{self.kv_cache_dtype!r} (--kv-cache-dtype)")
        elif params.get("remote_layout_digest") != self.digest:
            problem = (f"its layout {params.get('remote_layout_digest')!r} differs from this engine's "
                       f"{self.digest!r}")
        elif _block_lists(params.get("remote_block_ids"), len(self.groups)) is None:
            problem = f"remote_block_ids must be one list of block ids per transferable group ({len(self.groups)})"
        elif not all(isinstance(params.get(k), t) for k, t in (("transfer_id", str), ("remote_session", str),
                                                              ("remote_num_tokens", int), ("remote_layout", list),
                                                              ("expires_at", (int, float)))):
            problem = "transfer_id, remote_session, remote_num_tokens, remote_layout and expires_at are required"
        elif len(self.groups) != len(self.kv_cache_config.groups):
            problem = "a KV cache group of this model cannot be transferred"
        elif params.get("remote_prompt_digest") != prompt_digest(
                request.prompt_token_ids[:params["remote_num_tokens"]]):
            problem = "its prompt is not the one the prefill instance computed"
        if problem is not None:
            if not self._warned:
                self._warned = True
                logger.warning("KV transfer: request %s computes its prompt here: %s", request.request_id, problem)
            return None
        return params

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None:
            return 0, False
        if time.time() >= params["expires_at"]:
            return 0, False  # the prefill side has freed the blocks: compute the prompt here
        available = min(params["remote_num_tokens"], request.num_tokens - 1)
        self.stats.external_queried_tokens += max(0, available - num_computed_tokens)
        first, end = num_computed_tokens // self.block_size, -(-available // self.block_size)
        if available <= num_computed_tokens or any(
                len(ids) < end or min(ids[first:end], default=1) <= 0 for ids in params["remote_block_ids"]):
            return 0, False  # nothing beyond the local hit, or a block the prefill side no longer has (a window)
        return available - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = request.params.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._read.add(request.request_id)
        self.stats.external_hit_tokens += num_external_tokens
        self._meta.reads.append(RemoteRead(
            request.request_id, params["transfer_id"], params["remote_session"], tuple(params["remote_layout"]),
            [list(block_ids[g][first:end]) for g in self.groups],
            [ids[first:end] for ids in params["remote_block_ids"]],
            float(params["expires_at"])))

    # ---- scheduler side: both ----
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        params = request.params.kv_transfer_params or {}
        if params.get("do_remote_prefill"):  # decode side: a transfer it never read is released at once
            if request.request_id not in self._read and isinstance(params.get("remote_layout"), list):
                self._release(params)
            self._read.discard(request.request_id)
            return False, None
        if not (self.transfer_config.saves and params.get("do_remote_decode")):
            return False, None
        if request.num_computed_tokens < request.num_prompt_tokens:
            return False, None  # aborted before its prompt was computed: nothing worth sending
        transfer_id = params.get("transfer_id")
        if not (isinstance(transfer_id, str) and transfer_id) or transfer_id in self._held.values():
            transfer_id = uuid.uuid4().hex  # none given, or one already held: each transfer needs its own
        self._held[request.request_id] = transfer_id
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        agent = self.agent
        remote_ids = [list(block_ids[g][:num_blocks]) for g in self.groups]
        slots = (0, 0)
        if agent.staging is not None:  # copied out now: the decode side reads the staging slots
            first = agent.take_slots(num_blocks)
            if first is None:
                logger.warning("KV transfer: no %d free staging slots for request %s: the decode side computes "
                               "its prompt (raise staging_gib)", num_blocks, request.request_id)
                return False, None
            agent.stage_out(remote_ids, self._group_of_layer, list(self.groups), first)
            slots = (first, num_blocks)
            remote_ids = [list(range(first, first + num_blocks))] * len(self.groups)
        self._meta.holds.append(Hold(request.request_id, transfer_id, self.settings.timeout_s, slots))
        return True, {
            "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_engine_id": agent.engine_id, "remote_session": agent.session,
            "remote_layout": list(agent.layout_region), "remote_layout_digest": self.digest,
            "remote_kv_cache_dtype": self.kv_cache_dtype,
            "remote_block_ids": remote_ids,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_digest": prompt_digest(request.prompt_token_ids),
            "expires_at": time.time() + self.settings.timeout_s}

    def _release(self, params: dict) -> None:
        """Straight from here, on the agent's thread (one rank: it is in this process), so that no engine step
        has to run for it: the request is gone, and an idle engine does not step."""
        agent, session, region = self.agent, str(params.get("remote_session")), tuple(params["remote_layout"])
        transfer_id = str(params.get("transfer_id"))

        def release() -> None:
            try:
                agent.release(session, region, transfer_id)
            except Exception as e:  # noqa: BLE001 (the prefill side's timeout frees them then)
                logger.warning("KV transfer: releasing %s at %s failed (%s)", transfer_id, session, e)
        agent.submit(release)

    def build_connector_meta(self, out: SchedulerOutput) -> bytes:
        meta, self._meta = self._meta, TransferMetadata([], [])
        return _encode(meta) if meta.reads or meta.holds else b""

    def has_pending_work(self) -> bool:
        return bool(self._meta.reads or self._meta.holds)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for request_id in output.finished_sending:
            self._held.pop(request_id, None)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        agent = agent_for(self._key, self.settings.hostname, self.settings.engine_id)
        staging = self.settings.staging
        if staging is None:
            staging = kv_caches[0].device.type != "cpu"
        agent.register_kv_caches(kv_caches, self._group_of_layer, self.digest, len(self.kv_cache_config.groups),
                                 int(self.settings.staging_gib * 2**30) if staging else None)

    def start_load_kv(self, metadata: bytes) -> None:
        if not metadata:
            return
        meta = _decode(metadata)
        agent = self.agent
        now = time.monotonic()
        for hold in meta.holds:
            self._holds[hold.transfer_id] = hold
            self._expiry[hold.transfer_id] = now + hold.timeout_s
            if self._early.pop(hold.transfer_id, None) is not None:  # read before we heard of it
                self._end_hold(hold.transfer_id, self._report)
        for read in meta.reads:
            first = None
            local = read.local_block_ids
            if agent.staging is not None:  # into staging slots, then (get_finished) to the device
                first = agent.take_slots(len(local[0]))
                if first is None:
                    logger.warning("KV transfer: no %d free staging slots for request %s; it is recomputed",
                                   len(local[0]), read.request_id)
                    self._report.failed_recving.append(read.request_id)
                    continue
                local = [list(range(first, first + len(local[0])))] * len(local)
            future = agent.submit(lambda r=read, ids=local: self._timed_read(agent, r, ids))
            self._reads.append((read, future, first))

    def _end_hold(self, transfer_id: str, out: KVConnectorOutput, expired: bool = False) -> None:
        hold = self._holds.pop(transfer_id)
        del self._expiry[transfer_id]
        out.finished_sending.append(hold.request_id)
        if expired:
            out.failed_sending.append(hold.request_id)
        if hold.slots[1]:
            self.agent.give_back_slots(*hold.slots)

    def _timed_read(self, agent, read: RemoteRead, local_ids: list[list[int]]) -> tuple[int, float]:
        start = time.perf_counter()
        nbytes = agent.read_blocks(read.session, read.layout_region, list(self.groups), local_ids,
                                   read.remote_block_ids, read.transfer_id)
        if time.time() >= read.expires_at:
            raise TimeoutError(f"the read ended {time.time() - read.expires_at:.2f} s after the prefill side's "
                               "timeout: its blocks may have been reused")
        return nbytes, time.perf_counter() - start

    def get_finished(self) -> KVConnectorOutput:
        out, self._report = self._report, KVConnectorOutput()
        agent = find_agent(self._key)
        pending = []
        for event, first, n in self._releasing:
            if event.query():
                agent.give_back_slots(first, n)
            else:
                pending.append((event, first, n))
        self._releasing = pending
        still = []
        for read, future, first in self._reads:
            if not future.done():
                still.append((read, future, first))
                continue
            n = len(read.local_block_ids[0])
            if future.exception() is not None:
                logger.warning("KV transfer: reading request %s's KV from %s failed (%s); it is recomputed",
                               read.request_id, read.session, future.exception())
                out.failed_recving.append(read.request_id)
                if first is not None:
                    agent.give_back_slots(first, n)
                continue
            if first is not None:  # staged: to the device, in stream order before any step that reads it
                event = agent.stage_in(first, read.local_block_ids, self._group_of_layer, list(self.groups))
                if event is None:
                    agent.give_back_slots(first, n)
                else:
                    self._releasing.append((event, first, n))
            nbytes, seconds = future.result()
            out.loaded_bytes += nbytes
            out.load_seconds += seconds
            out.finished_recving.append(read.request_id)
        self._reads = still
        if self._holds or self._early or self.transfer_config.saves:
            now = time.monotonic()
            for transfer_id in agent.notifications():
                if transfer_id in self._holds:
                    self._end_hold(transfer_id, out)
                else:
                    self._early[transfer_id] = now
            for transfer_id, expiry in list(self._expiry.items()):
                if now >= expiry:
                    logger.warning("KV transfer %s (request %s) was not read within %g s: its blocks are freed",
                                   transfer_id, self._holds[transfer_id].request_id, self.settings.timeout_s)
                    self._end_hold(transfer_id, out, expired=True)
            horizon = now - self.settings.timeout_s
            self._early = {t: when for t, when in self._early.items() if when > horizon}
        return out
