"""Encoder disaggregation end to end on the tiny LLaVA: an encoder-only instance (ec_producer), a combined
prefill/decode instance (ec_consumer) and `surge proxy --encode ... --decode ...`, each its own process on
127.0.0.1, sharing an ECSharedStorageConnector directory, driven by the official openai client. The reference is a
single plain instance: greedy outputs of Chat and Responses with images (streamed or not, one or two images) must be
identical, with the embeddings loaded rather than encoded on the PD instance; requests without images never reach
the encoder instance; with the encoder instance killed, outputs stay identical and every image is counted as a
fallback (surge:encoder_fallback_total) on the PD instance and surge_proxy:encoder_fallbacks on the proxy."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from remote_server import RemoteServer
from serving_cluster import ProxyProcess, kill, start_side_by_side, stop_cluster

from tiny_vlm import make_tiny_llava

SERVE = ("--served-model-name", "llava", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20),
         "--dtype", "float32")


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (30, 20, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ec(store, role: str) -> tuple[str, str]:
    return "--ec-transfer-config", json.dumps({"ec_connector": "ECSharedStorageConnector", "ec_role": role,
                                               "ec_connector_extra_config": {"shared_storage_path": str(store)}})


def proxy_fallbacks(proxy: ProxyProcess) -> float:
    """surge_proxy:encoder_fallbacks_total from the proxy's /metrics."""
    for line in httpx.get(proxy.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("surge_proxy:encoder_fallbacks_total "):
            return float(line.split()[1])
    raise AssertionError("surge_proxy:encoder_fallbacks_total is missing")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    store = tmp_path_factory.mktemp("ec-store")
    single, encoder, pd = start_side_by_side(lambda: RemoteServer(model, *SERVE),
                                             lambda: RemoteServer(model, *SERVE, *ec(store, "ec_producer")),
                                             lambda: RemoteServer(model, *SERVE, *ec(store, "ec_consumer")))
    proxy = ProxyProcess("--encode", encoder.url, "--decode", pd.url)
    state = {"single": single, "encoder": encoder, "pd": pd, "proxy": proxy, "store": store}
    try:
        yield state
    finally:
        stop_cluster(proxy, [pd, encoder, single])


def run_all(client: openai.OpenAI, seeds: tuple[int, int, int]) -> dict[str, str]:
    """Chat (streamed and not, one image then two) and Responses with an image, greedy: the texts."""
    a, b, c = (data_url(s) for s in seeds)
    one = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                        {"type": "image_url", "image_url": {"url": a}}]}]
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": b}},
                                        {"type": "text", "text": "and"},
                                        {"type": "image_url", "image_url": {"url": a}}]}]
    chat = {"model": "llava", "max_tokens": 8, "temperature": 0}
    return {
        "chat": client.chat.completions.create(messages=one, **chat).choices[0].message.content,
        "chat-two": client.chat.completions.create(messages=two, **chat).choices[0].message.content,
        "chat-stream": "".join(ch.choices[0].delta.content or "" for ch in
                               client.chat.completions.create(messages=one, stream=True, **chat) if ch.choices),
        "responses": client.responses.create(
            model="llava", max_output_tokens=8, temperature=0,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                                {"type": "input_image", "image_url": c}]}]).output_text,
    }


def test_outputs_match_a_single_instance_with_the_embeddings_from_the_encoder(cluster):
    encoder, pd = cluster["encoder"], cluster["pd"]
    reference = run_all(cluster["single"].client(), (1, 2, 3))
    assert all(reference.values()), reference
    before_e, before_pd = encoder.metrics(), pd.metrics()
    assert run_all(cluster["proxy"].client(), (1, 2, 3)) == reference
    after_e, after_pd = encoder.metrics(), pd.metrics()
    assert after_e["surge:ec_connector_saved_images_total"] - before_e["surge:ec_connector_saved_images_total"] == 5
    # Loaded for every prompt whose image span the prefix cache did not cover: the first image twice (in the
    # two-image prompt it follows another), the others once; the streamed chat's prompt was all a prefix hit.
    loaded = "surge:ec_connector_loaded_images_total"
    assert after_pd[loaded] - before_pd[loaded] == 4
    assert after_pd["surge:encoder_fallback_total"] == before_pd["surge:encoder_fallback_total"]
    assert proxy_fallbacks(cluster["proxy"]) == 0


def test_requests_without_images_never_reach_the_encoder(cluster):
    encoder, proxy = cluster["encoder"], cluster["proxy"]
    before = encoder.metrics()
    chat = proxy.client().chat.completions.create(model="llava", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0)
    reference = cluster["single"].client().chat.completions.create(
        model="llava", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == reference.choices[0].message.content
    proxy.client().completions.create(model="llava", prompt="hi", max_tokens=4)
    after = encoder.metrics()
    assert after["surge:prompt_tokens_total"] == before["surge:prompt_tokens_total"]
    assert after["surge:ec_connector_saved_images_total"] == before["surge:ec_connector_saved_images_total"]


def test_with_the_encoder_down_the_pd_instance_encodes_and_counts(cluster):
    encoder, pd, proxy = cluster["encoder"], cluster["pd"], cluster["proxy"]
    kill(encoder)
    reference = run_all(cluster["single"].client(), (4, 5, 6))
    before = pd.metrics()
    assert run_all(proxy.client(), (4, 5, 6)) == reference
    after = pd.metrics()
    assert after["surge:encoder_fallback_total"] - before["surge:encoder_fallback_total"] == 4  # as loaded above
    assert after["surge:ec_connector_loaded_images_total"] == before["surge:ec_connector_loaded_images_total"]
    assert proxy_fallbacks(proxy) == 4  # every request with images
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
