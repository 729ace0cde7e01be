"""The launcher's rules, without processes: daemon ranks come from the engine's own mapping (TP=8 over two nodes puts
global ranks 4-7 on node 1), the daemons' rendezvous port is required across nodes and never the engine's, and
/health answers 503 until ready, then 200."""
from __future__ import annotations

import pytest

from surge.config import ParallelConfig
from surge.engine.args import EngineArgs
from surge.distributed.ranks import node_ranks
from surge.weight_cache.launcher import HealthServer, Launcher, daemon_parallel_config, daemon_ranks
from weight_cache_daemons import get_health


def test_tp8_over_two_nodes_puts_ranks_4_to_7_on_node_1():
    node1 = ParallelConfig(tensor_parallel_size=8, nnodes=2, node_rank=1, master_port=29500)
    assert daemon_ranks(node1) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    node0 = ParallelConfig(tensor_parallel_size=8, nnodes=2, node_rank=0, master_port=29500)
    assert [rank for _, rank in daemon_ranks(node0)] == [0, 1, 2, 3]
    for pc in (node0, node1):  # the engine's executor places its ranks with the same function
        assert [rank for _, rank in daemon_ranks(pc)] == list(node_ranks(pc.node_rank, pc.local_world_size))


def test_daemons_rendezvous_on_their_own_port():
    two_nodes = ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=29500)
    with pytest.raises(ValueError, match="--weight-cache-master-port is required when nnodes=2"):
        daemon_parallel_config(two_nodes, None)
    with pytest.raises(ValueError, match="equals --master-port"):
        daemon_parallel_config(two_nodes, 29500)
    assert daemon_parallel_config(two_nodes, 29600).master_port == 29600
    one_node = ParallelConfig(tensor_parallel_size=2)
    assert daemon_parallel_config(one_node, None).master_port is not None  # a free port of their own
    assert daemon_parallel_config(ParallelConfig(), None).master_port is None  # one rank: no process group


def test_launcher_health_is_503_until_its_daemons_are_ready(llama_dir, tmp_path):
    config = EngineArgs(llama_dir, device="cpu", max_model_len=128).create_engine_config()
    launcher = Launcher(config, str(tmp_path / "s"), health_port=0)  # nothing started yet: loading
    try:
        code, body = get_health(launcher.health.port)
        assert (code, body["status"], body["node_rank"]) == (503, "loading", 0)
    finally:
        launcher.shutdown()


def test_health_endpoint_503_while_loading_then_200():
    state = {"ready": False}
    server = HealthServer("127.0.0.1", 0, lambda: (200, {"status": "ready"}) if state["ready"]
                          else (503, {"status": "loading"}))
    try:
        assert get_health(server.port) == (503, {"status": "loading"})
        state["ready"] = True
        assert get_health(server.port) == (200, {"status": "ready"})
        assert get_health(server.port, "/metrics")[0] == 404
    finally:
        server.close()
