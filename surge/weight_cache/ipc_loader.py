"""The engine side of Fast Start, the loader of load_format="weight_cache": ask this rank's daemon for its weights
and bind them into a model built on the meta device, with no copy (zero_copy) or as private copies after which the
daemon releases its own (copy). Importing this module registers the loader (surge/model/loader/base.py).

Any reason the cache cannot serve (no daemon, still loading, a key mismatch, weights released, ...) is raised as
WeightCacheUnavailable; base.load_model then loads from disk with a warning that states it, or with fallback off
fails with that reason. The daemon holds weights already processed exactly as a disk load would leave them, so the
engine processes nothing and never writes into memory it shares.
"""
from __future__ import annotations

import os
import resource
import socket
import time

import torch
from torch import nn

from surge.config import EngineConfig
from surge.distributed.parallel_state import get_tp_group
from surge.logger import init_logger
from surge.model.loader.base import LoaderUnavailable, build_model, register_loader
from surge.weight_cache.key import cuda_index, socket_name, weight_cache_key
from surge.weight_cache.protocol import (ConnectionClosed, DaemonClient, ErrorReply, GetState, ProtocolError,
                                         Release, ReleaseReply, StateReply)
from surge.weight_cache.socket_dir import (UnsafePathError, check_private_dir, check_socket, lock_holder, lock_path,
                                           resolve_socket_dir)
from surge.weight_cache.tensor_table import (TableMismatchError, bind_tensors, clone_storages, named_tensors,
                                             open_storages)

logger = init_logger(__name__)


class WeightCacheError(RuntimeError):
    """The weight cache cannot serve and fallback is off."""


class WeightCacheUnavailable(LoaderUnavailable):
    """Why the weight cache cannot serve this rank; the message is the reason, written for people."""
    source = "weight cache"
    error = WeightCacheError


@register_loader("weight_cache")
def load_from_weight_cache(config: EngineConfig, device: torch.device) -> nn.Module:
    rank = get_tp_group().rank
    start = time.perf_counter()
    model = fetch_model(config, device, rank)
    seconds = time.perf_counter() - start
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for _, t, _ in named_tensors(model)}
    where = ("held by the daemon: memory already in use, so the KV cache budget, a share of what is free, counts it"
             if config.weight_cache_config.mode == "zero_copy" else "copied; the daemon released its copy")
    logger.info("weight cache: rank %d took %.2f GiB of weights from the daemon in %.2f s (%s)", rank,
                sum(storages.values()) / 2**30, seconds, where)
    return model


def _reason_from_error(reply: ErrorReply) -> str:
    if reply.code == "key_mismatch":
        return reply.message
    if reply.code == "released":
        return ("the daemon's weights were released (a copy-mode engine took them); restart the daemon to load "
                "them again")
    return f"the daemon refused the request ({reply.code}: {reply.message})"


def _connect(path, timeout: float, rank: int) -> DaemonClient:
    what = f"rank {rank}"
    try:
        check_private_dir(path.parent)
        check_socket(path)
        return DaemonClient(path, timeout)
    except FileNotFoundError:
        holder = lock_holder(lock_path(path))
        if holder is not None:
            raise WeightCacheUnavailable(f"the weight-cache daemon for {what} (pid {holder}) is still loading: "
                                         f"{path} is not bound yet") from None
        raise WeightCacheUnavailable(f"no weight-cache daemon serves {what}: no socket at {path}") from None
    except ConnectionRefusedError:
        raise WeightCacheUnavailable(f"the weight-cache daemon for {what} is not running: {path} is a stale socket "
                                     "(connection refused)") from None
    except UnsafePathError as e:
        raise WeightCacheUnavailable(str(e)) from None
    except socket.timeout:
        raise WeightCacheUnavailable(f"the weight-cache daemon at {path} did not accept within {timeout:.0f} s") \
            from None
    except OSError as e:
        raise WeightCacheUnavailable(f"cannot connect to the weight-cache daemon at {path}: {e}") from None


def _ensure_fd_room(count: int) -> None:
    """Each CPU storage keeps one descriptor open while mapped: make room for them under RLIMIT_NOFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + count + 64
    if soft != resource.RLIM_INFINITY and want > soft:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def fetch_model(config: EngineConfig, device: torch.device, rank: int) -> nn.Module:
    """This rank's model, bound to the daemon's tensors (zero_copy) or to copies of them (copy); raises
    WeightCacheUnavailable with the reason when the daemon cannot serve."""
    wc, mc = config.weight_cache_config, config.model_config
    if device.type == "cuda":
        device = torch.device("cuda", cuda_index(device))  # IPC handles open on an explicit index
    key = weight_cache_key(mc, config.parallel_config, rank, device)
    path = resolve_socket_dir(wc.socket_dir) / socket_name(device, rank)
    client = _connect(path, wc.timeout, rank)
    try:
        reply = client.request(GetState(key=key, mode=wc.mode))
        if isinstance(reply, ErrorReply):
            raise WeightCacheUnavailable(_reason_from_error(reply))
        if not isinstance(reply, StateReply):
            raise WeightCacheUnavailable(f"the daemon answered get_state with a {type(reply).__name__}")
        if reply.device_kind != device.type:
            raise WeightCacheUnavailable(f"the daemon holds {reply.device_kind} tensors; this rank runs on {device}")
        if reply.num_fds:
            _ensure_fd_room(reply.num_fds)
        fds = client.recv_fds(reply.num_fds) if reply.num_fds else []
        try:
            storages = open_storages(reply.storages, fds, device)
        finally:
            for fd in fds:
                os.close(fd)
        if wc.mode == "copy":
            storages = clone_storages(storages)  # the mapped originals go when this list is replaced
        model = build_model(mc, torch.device("meta"))
        bind_tensors(model, reply.tensors, reply.aliases, storages)
        del storages
        if wc.mode == "copy":
            _release(client, key, rank)
        return model
    except socket.timeout:
        raise WeightCacheUnavailable(f"the weight-cache daemon at {path} did not answer within {wc.timeout:.0f} s") \
            from None
    except ConnectionClosed:
        raise WeightCacheUnavailable(f"the weight-cache daemon at {path} closed the connection (it stopped or died)") \
            from None
    except ProtocolError as e:
        raise WeightCacheUnavailable(f"the weight-cache daemon at {path} broke the protocol: {e}") from None
    except TableMismatchError as e:
        raise WeightCacheUnavailable(str(e)) from None
    except OSError as e:
        raise WeightCacheUnavailable(f"talking to the weight-cache daemon at {path} failed: {e}") from None
    except RuntimeError as e:  # torch, mapping the storages
        raise WeightCacheUnavailable(f"mapping the daemon's tensors failed: {e}") from None
    finally:
        client.close()


def _release(client: DaemonClient, key, rank: int) -> None:
    """copy mode: this engine has its own copy; the daemon frees its. A failure costs memory, not correctness."""
    try:
        reply = client.request(Release(key=key))
    except (OSError, ProtocolError) as e:
        logger.warning("weight cache: rank %d copied its weights but could not ask the daemon to release: %s", rank, e)
        return
    if isinstance(reply, ReleaseReply):
        logger.info("weight cache: rank %d copied its weights; the daemon released %.1f MiB", rank,
                    reply.freed_bytes / 2**20)
    else:
        logger.warning("weight cache: rank %d copied its weights but the daemon did not release: %s", rank, reply)
