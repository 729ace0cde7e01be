"""Encoder disaggregation in one process, through the ECSharedStorageConnector on the tiny LLaVA: an encoder-only
engine (ec_producer) answers with no tokens and saves each distinct image's embeddings once; a consumer engine
loads them instead of encoding (its greedy tokens equal a plain engine's, and embeddings planted in the store
change them, so the loaded rows are the ones used); an image the store lacks is encoded locally and counted."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from surge import LLM, SamplingParams
from surge.config import ECTransferConfig
from surge.ec_transfer.factory import create_ec_connector
from tiny_models import make_tiny_model
from tiny_vlm import make_tiny_llava

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_model_len=128)


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (20, 24, 3), dtype=np.uint8))


def prompts(*seeds: int) -> list[dict]:
    return [{"prompt": f"look {i} <image> what", "multi_modal_data": {"image": image(seed)}}
            for i, seed in enumerate(seeds)]


def ec(path, role: str) -> dict:
    return {"ec_connector": "ECSharedStorageConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    store = tmp_path_factory.mktemp("ec-store")
    return (model, store, LLM(model, **ENGINE), LLM(model, **ENGINE, ec_transfer_config=ec(store, "ec_producer")),
            LLM(model, **ENGINE, ec_transfer_config=ec(store, "ec_consumer")))


def tokens(llm: LLM, batch: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def test_the_consumer_loads_what_the_encoder_saved_and_matches_a_plain_engine(engines):
    _, store, plain, encoder, consumer = engines
    batch = prompts(1, 2, 1)  # the first image twice: encoded and saved once
    encoded = encoder.generate(batch, GREEDY, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in encoded] == [([], "length")] * 3
    assert encoder.engine.get_stats().ec_saved_images == 2
    assert len(list(store.glob("*.safetensors"))) == 2
    before = consumer.engine.get_stats()
    assert tokens(consumer, batch) == tokens(plain, batch)
    after = consumer.engine.get_stats()
    assert after.ec_loaded_images - before.ec_loaded_images == 2
    assert after.encoder_fallbacks == before.encoder_fallbacks


def test_planted_embeddings_are_the_ones_merged(engines):
    """Rows saved under an image's hash replace its encoding: zeros give other tokens than the real embeddings."""
    model, store, plain, encoder, consumer = engines
    batch = prompts(3)
    feature = consumer.input_processor.process(batch[0])[2][0]
    connector = create_ec_connector(encoder.config)
    connector.save(feature.identifier, torch.zeros(feature.length, encoder.config.model_config.hidden_size))
    assert tokens(consumer, batch) != tokens(plain, batch)
    encoder.generate(batch, GREEDY, use_tqdm=False)  # the real ones overwrite them
    consumer.reset_prefix_cache()  # which keyed the planted rows' KV by the same image hash
    assert tokens(consumer, batch) == tokens(plain, batch)


def test_an_image_the_store_lacks_is_encoded_locally_and_counted(engines):
    _, _, plain, _, consumer = engines
    batch = prompts(4, 5)  # never sent to the encoder
    before = consumer.engine.get_stats()
    assert tokens(consumer, batch) == tokens(plain, batch)
    after = consumer.engine.get_stats()
    assert after.encoder_fallbacks - before.encoder_fallbacks == 2
    assert after.ec_loaded_images == before.ec_loaded_images
    assert tokens(consumer, prompts(6)[:0] + [{"prompt": "text only"}]) == tokens(plain, [{"prompt": "text only"}])
    assert consumer.engine.get_stats().encoder_fallbacks == after.encoder_fallbacks  # no image, nothing asked


def test_bad_configs_are_clear_errors(tmp_path, engines):
    with pytest.raises(ValueError, match="ec_role='ec_both_ways'"):
        ECTransferConfig.parse({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_both_ways"})
    with pytest.raises(ValueError, match="unknown keys"):
        ECTransferConfig.parse('{"ec_connector": "ECSharedStorageConnector", "ec_rol": "ec_producer"}')
    with pytest.raises(ValueError, match="shared_storage_path"):
        LLM(engines[0], **ENGINE, ec_transfer_config={"ec_connector": "ECSharedStorageConnector"})
    with pytest.raises(ValueError, match="ec_connector='Nope' is unknown"):
        LLM(engines[0], **ENGINE, ec_transfer_config={"ec_connector": "Nope"})
    with pytest.raises(ValueError, match="needs a multimodal model; LlamaForCausalLM takes no images"):
        LLM(make_tiny_model("llama", tmp_path / "llama"), **ENGINE, ec_transfer_config=ec(tmp_path, "ec_consumer"))
