"""The ECMooncakeStoreConnector against a real Mooncake store (master, metadata server and memory holder on free
loopback ports): an encoder-only engine saves each image's embeddings, a consumer engine loads them and answers as
a plain engine does; with the store gone, the consumer encodes locally (counted) and still answers the same."""
from __future__ import annotations

import pytest

from surge import LLM
from surge.kv_transfer.mooncake_server import MooncakeStoreServer
from test_ec_shared_storage import ENGINE, GREEDY, prompts, tokens
from tiny_vlm import make_tiny_llava


def test_embeddings_go_through_the_store_and_a_dead_store_costs_only_encoder_time(tmp_path):
    model = make_tiny_llava(tmp_path / "tiny-llava")
    server = MooncakeStoreServer(segment_size=64 << 20, log_dir=tmp_path / "mooncake").start()
    try:
        extra = {"master": server.master_address, "metadata_server": server.metadata_server,
                 "transfer_timeout_s": 5.0, "connect_timeout_s": 5.0}
        config = {"ec_connector": "ECMooncakeStoreConnector", "ec_connector_extra_config": extra}
        plain = LLM(model, **ENGINE)
        encoder = LLM(model, **ENGINE, ec_transfer_config={**config, "ec_role": "ec_producer"})
        consumer = LLM(model, **ENGINE, ec_transfer_config={**config, "ec_role": "ec_consumer"})
        batch = prompts(1, 2)
        assert tokens(encoder, batch) == [[], []]
        assert encoder.engine.get_stats().ec_saved_images == 2
        assert tokens(consumer, batch) == tokens(plain, batch)
        stats = consumer.engine.get_stats()
        assert (stats.ec_loaded_images, stats.encoder_fallbacks) == (2, 0)
    finally:
        server.stop()
    batch = prompts(3)
    assert tokens(consumer, batch) == tokens(plain, batch)
    assert consumer.engine.get_stats().encoder_fallbacks == 1
    with pytest.raises(Exception, match="Mooncake store"):
        encoder.generate(batch, GREEDY, use_tqdm=False)
