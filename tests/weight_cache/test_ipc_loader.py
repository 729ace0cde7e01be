"""The engine's side, against a daemon in this process: the mapped model equals a disk load tensor for tensor
(names, shapes, dtypes, strides, sha256) and generates the same tokens; tied weights stay one tensor, rotary tables
(non-persistent buffers) arrive, zero_copy shares the daemon's memory, copy mode makes the daemon release. Every
reason the cache cannot serve falls back to disk with a warning naming it, or fails with it when fallback is off."""
from __future__ import annotations

import os
import re

import pytest
import torch

from surge import LLM
from surge.config import EngineConfig
from surge.engine.args import EngineArgs
from surge.model.loader.base import load_from_disk
from surge.weight_cache.ipc_loader import WeightCacheError, fetch_model
from surge.weight_cache.parity import diff_fingerprints, fingerprint
from surge.weight_cache.protocol import DaemonClient, GetMemory
from surge.weight_cache.socket_dir import DaemonLock, ensure_private_dir, lock_path
from tiny_models import make_tiny_model
from weight_cache_daemons import ENGINE, cached, generate, running_daemon

def _config(model_dir, socket_dir, **kwargs) -> EngineConfig:
    return EngineArgs(model_dir, device="cpu", max_model_len=128, **cached(socket_dir, **kwargs)).create_engine_config()


def test_parity_with_a_disk_load(daemon, tied_dir):
    config = _config(tied_dir, daemon.socket_dir)
    model = fetch_model(config, torch.device("cpu"), 0)
    disk = load_from_disk(config.model_config, torch.device("cpu"))
    ours, reference = fingerprint(model), fingerprint(disk)
    assert diff_fingerprints(ours, reference) == []
    assert "layers.0.self_attn.rotary.cos_cache" in ours  # buffers, not only the state dict
    with torch.no_grad():
        disk.layers[1].mlp.down_proj.weight[0, 0] += 1
    assert diff_fingerprints(ours, fingerprint(disk)) == [
        f"layers.1.mlp.down_proj.weight: sha256 {ours['layers.1.mlp.down_proj.weight'].sha256} (weight cache) != "
        f"{fingerprint(disk)['layers.1.mlp.down_proj.weight'].sha256} (disk)"]


def test_tied_weights_and_rotary_tables_are_aliases(daemon, tied_dir):
    aliases = dict(daemon.table.aliases)
    assert aliases["lm_head.weight"] == "embed_tokens.weight"
    assert aliases["layers.3.self_attn.rotary.sin_cache"] == "layers.0.self_attn.rotary.sin_cache"
    names = {e.name: e.kind for e in daemon.table.tensors}
    assert names["layers.0.self_attn.rotary.cos_cache"] == "buffer" and "lm_head.weight" not in names
    model = fetch_model(_config(tied_dir, daemon.socket_dir), torch.device("cpu"), 0)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[2].self_attn.rotary.cos_cache is model.layers[0].self_attn.rotary.cos_cache
    assert "cos_cache" in model.layers[0].self_attn.rotary._non_persistent_buffers_set


def test_zero_copy_shares_the_daemons_memory(daemon, tied_dir):
    model = fetch_model(_config(tied_dir, daemon.socket_dir), torch.device("cpu"), 0)
    ours, theirs = model.layers[0].mlp.down_proj.weight, daemon.model.layers[0].mlp.down_proj.weight
    assert ours.untyped_storage().is_shared() and ours.data_ptr() != theirs.data_ptr()  # two mappings, one memory
    with torch.no_grad():
        old = theirs[0, 0].item()
        theirs[0, 0] = 123.0
        assert ours[0, 0].item() == 123.0
        theirs[0, 0] = old


def test_generation_matches_a_disk_load(daemon, tied_dir):
    reference = generate(tied_dir)
    assert generate(tied_dir, **cached(daemon.socket_dir, weight_cache_fallback=False)) == reference
    assert generate(tied_dir, **cached(daemon.socket_dir, weight_cache_mode="copy")) == reference


def test_copy_mode_takes_a_copy_and_the_daemon_releases(daemon, tied_dir, loader_log):
    model = fetch_model(_config(tied_dir, daemon.socket_dir, weight_cache_mode="copy"), torch.device("cpu"), 0)
    assert not model.embed_tokens.weight.untyped_storage().is_shared()
    assert model.lm_head.weight is model.embed_tokens.weight
    with DaemonClient(daemon.socket_path, 10) as client:
        memory = client.request(GetMemory())
    assert (memory.state, memory.device_bytes, memory.num_tensors) == ("released", 0, 0)
    assert daemon.model is None and daemon.table is None
    assert generate(tied_dir, **cached(daemon.socket_dir)) == generate(tied_dir)  # falls back, with the reason
    assert "the daemon's weights were released" in loader_log.take()
    with pytest.raises(WeightCacheError, match="weights were released"):
        LLM(tied_dir, **{**ENGINE, **cached(daemon.socket_dir, weight_cache_fallback=False)})


def _falls_back(model_dir, socket_dir, loader_log, reason: str, **kwargs) -> str:
    """Output as from disk, with a warning stating `reason` (a regex); fallback off: an error stating it."""
    loader_log.take()
    assert generate(model_dir, **cached(socket_dir, **kwargs)) == generate(model_dir)
    err = loader_log.take()
    assert re.search(r"weight cache cannot serve rank 0: .*" + reason + r".*; loading from disk instead$", err), err
    with pytest.raises(WeightCacheError, match=reason + r".*\(fallback is off\)"):
        LLM(model_dir, **{**ENGINE, **cached(socket_dir, weight_cache_fallback=False, **kwargs)})
    return err


def test_no_daemon_falls_back(tied_dir, tmp_path, loader_log):
    _falls_back(tied_dir, ensure_private_dir(tmp_path / "empty"), loader_log,
                re.escape(f"no weight-cache daemon serves rank 0: no socket at {tmp_path}/empty/rank-0.sock"))


def test_daemon_still_loading_falls_back(tied_dir, tmp_path, loader_log):
    socket_dir = ensure_private_dir(tmp_path / "s")
    lock = DaemonLock(lock_path(socket_dir / "rank-0.sock"))
    lock.acquire()  # a daemon that holds its lock but has not bound its socket yet
    try:
        _falls_back(tied_dir, socket_dir, loader_log, rf"\(pid {os.getpid()}\) is still loading")
    finally:
        lock.release()


def test_key_mismatch_falls_back_naming_the_field(daemon, tied_dir, loader_log):
    _falls_back(tied_dir, daemon.socket_dir, loader_log, re.escape("key mismatch: dtype (daemon 'float32', engine "
                                                              "'bfloat16')"), dtype="bfloat16")
    assert daemon.state == "ready"


def test_unsafe_directory_falls_back(daemon, tied_dir, loader_log):
    os.chmod(daemon.socket_dir, 0o755)
    try:
        _falls_back(tied_dir, daemon.socket_dir, loader_log, "open to other users")
    finally:
        os.chmod(daemon.socket_dir, 0o700)


def test_daemon_of_another_checkpoint_is_a_key_mismatch(tied_dir, tmp_path, loader_log):
    """Same config and shapes, other weights (another seed): only the checkpoint identity tells them apart."""
    other_dir = make_tiny_model("llama-tied", tmp_path / "other", seed=1)
    with running_daemon(other_dir, tmp_path / "s") as other:
        err = _falls_back(tied_dir, other.socket_dir, loader_log, r"key mismatch: checkpoint \(daemon '[0-9a-f]+', "
                          r"engine '[0-9a-f]+'\)")
    assert "model_config" not in err and "dtype" not in err
