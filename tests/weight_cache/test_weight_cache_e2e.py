"""End to end through `surge weight-cache serve`: the launcher's daemons serve engines at TP=1, TP=2 and two nodes on
one machine, with output token-identical to a disk load; /health says ready, then released after a copy-mode engine;
SIGTERM removes sockets and locks and ends every daemon; a daemon killed before the engine connects leaves a stale
socket that engines fall back past and the next daemon replaces; a second launcher is stopped by the lock."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from surge import LLM
from surge.weight_cache.ipc_loader import WeightCacheError
from surge.weight_cache.launcher import socket_states
from tiny_models import make_tiny_model
from weight_cache_daemons import ENGINE, ServeProcess, cached, generate, get_health, wait_gone

def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_tp1_health_copy_release_and_sigterm(llama_dir, tmp_path):
    reference = generate(llama_dir)
    socket_dir = tmp_path / "s"
    (port,) = free_ports(1)
    with ServeProcess(llama_dir, socket_dir, "--health-port", str(port)) as serve:
        assert "READY node 0: 1 daemon(s) serve ranks [0]" in serve.log()
        assert get_health(port) == (200, {"status": "ready", "node_rank": 0, "ranks": {"0": "ready"}})
        assert generate(llama_dir, **cached(socket_dir, weight_cache_fallback=False)) == reference
        daemon_pid = serve.daemon_pid()
        assert generate(llama_dir, **cached(socket_dir, weight_cache_mode="copy",
                                            weight_cache_fallback=False)) == reference
        code, body = get_health(port)
        assert (code, body["status"]) == (503, "released")
        assert serve.stop() == 0
    assert "rank 0: stopped" in serve.log()
    assert wait_gone(daemon_pid, 10)
    assert sorted(p.name for p in socket_dir.iterdir()) == []  # socket and lock file removed


def test_tp2_matches_a_disk_load_and_each_rank_falls_back_alone(llama_dir, tmp_path, capfd):
    reference = generate(llama_dir)
    socket_dir = tmp_path / "s"
    with ServeProcess(llama_dir, socket_dir, "-tp", "2", num_sockets=2) as serve:
        assert generate(llama_dir, tp=2, **cached(socket_dir, weight_cache_fallback=False)) == reference
        assert "rank 1: served" in serve.log() and "rank 0: served" in serve.log()
    capfd.readouterr()
    assert generate(llama_dir, tp=2, **cached(socket_dir)) == reference  # no daemon: each rank reads the disk
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"weight cache cannot serve rank {rank}: no weight-cache daemon serves rank {rank}" in err


def test_two_nodes_on_one_machine(tmp_path):
    """nnodes=2, one rank each: a launcher per node (their daemons meet on their own port), node 1's engine is
    `surge generate --node-rank 1` (headless), node 0's this process; each rank maps its shard from its node."""
    model_dir = make_tiny_model("qwen3-hybrid", tmp_path / "m")
    reference = generate(model_dir)
    socket_dir = tmp_path / "s"
    wc_port, engine_port = free_ports(2)
    nodes = ("-tp", "2", "--nnodes", "2", "--master-port", str(engine_port), "--weight-cache-master-port", str(wc_port))
    serves = [ServeProcess(model_dir, socket_dir, *nodes, "--node-rank", str(n), wait=False) for n in (0, 1)]
    node1 = None
    try:
        for serve in serves:
            serve.num_sockets = 2  # both nodes' sockets share the directory on one machine
            serve.wait_ready()
        node1 = subprocess.Popen(
            [sys.executable, "-m", "surge.entrypoints.cli.main", "generate", "--model", str(model_dir), "--device",
             "cpu", "--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", str(1 << 22),
             "--max-num-batched-tokens", "24", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port",
             str(engine_port), "--load-format", "weight_cache", "--weight-cache-dir", str(socket_dir),
             "--no-weight-cache-fallback"], stdin=subprocess.DEVNULL)
        out = generate(model_dir, tp=2, nnodes=2, node_rank=0, master_port=engine_port,
                       **cached(socket_dir, weight_cache_fallback=False))
        assert node1.wait(timeout=60) == 0
    finally:
        if node1 is not None and node1.poll() is None:
            node1.kill()
            node1.wait()
        for serve in serves:
            serve.stop()
    assert out == reference
    assert "READY node 0: 1 daemon(s) serve ranks [0]" in serves[0].log()
    assert "READY node 1: 1 daemon(s) serve ranks [1]" in serves[1].log()
    assert "rank 1: served" in serves[1].log()


def test_daemon_killed_before_the_engine_connects(llama_dir, tmp_path, loader_log):
    reference = generate(llama_dir)
    socket_dir = tmp_path / "s"
    with ServeProcess(llama_dir, socket_dir) as serve:
        os.kill(serve.daemon_pid(), signal.SIGKILL)
        assert serve.proc.wait(30) == 1  # the launcher notices and stops
        assert "exited with code -9" in serve.log()
    assert (socket_dir / "rank-0.sock").exists()  # stale: nobody removed it
    assert generate(llama_dir, **cached(socket_dir)) == reference
    warning = loader_log.take()
    assert "the weight-cache daemon for rank 0 is not running: " in warning
    assert "rank-0.sock is a stale socket (connection refused); loading from disk instead" in warning
    with pytest.raises(WeightCacheError, match=r"stale socket \(connection refused\) \(fallback is off\)"):
        LLM(llama_dir, **{**ENGINE, **cached(socket_dir, weight_cache_fallback=False)})
    with ServeProcess(llama_dir, socket_dir):  # the next daemon replaces the stale socket
        assert generate(llama_dir, **cached(socket_dir, weight_cache_fallback=False)) == reference


def test_a_second_launcher_is_stopped_by_the_lock(llama_dir, tmp_path):
    socket_dir = tmp_path / "s"
    with ServeProcess(llama_dir, socket_dir) as first:
        second = ServeProcess(llama_dir, socket_dir, wait=False)
        try:
            assert second.proc.wait(60) == 1
        finally:
            second.stop()
        assert f"another weight-cache daemon (pid {first.daemon_pid()}) holds" in second.log()
        assert socket_states(socket_dir) == {"rank-0.sock": "ready"}
