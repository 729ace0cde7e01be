"""Chat Completions and Responses with images: `image_url` / `input_image` parts (data: URLs; files under
--allowed-local-media-path; http(s) from --allowed-media-domains, here a local server on 127.0.0.1) reach a
multimodal model (the tiny LLaVA) and answer as HF transformers does, through raw HTTP and the official openai
client; other URLs, undecodable or oversized images and too many of them are 400s naming the rule; a large image
being processed does not stall the server."""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from media_server import MediaServer
from remote_server import RemoteServer
from tiny_vlm import make_tiny_llava
from vlm_parity import data_url

CHAT = "/v1/chat/completions"


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


IMAGE = Image.fromarray(np.random.RandomState(5).randint(0, 255, (30, 20, 3), dtype=np.uint8))
IMAGE_LIMIT = 2


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png_bytes(IMAGE))
    (root / "secret.png").write_bytes(png_bytes(IMAGE))
    (root / "allowed" / "escape.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def media_server():
    with MediaServer({"cat.png": png_bytes(IMAGE)}) as server:
        yield server


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory, media_dir):
    path = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    with RemoteServer(path, "--served-model-name", "llava", "--max-model-len", "256", "--kv-cache-memory",
                      str(16 << 20), "--dtype", "float32", "--allowed-media-domains", "127.0.0.1",
                      "--allowed-local-media-path", str(media_dir / "allowed"),
                      "--limit-mm-per-prompt", json.dumps({"image": IMAGE_LIMIT})) as server:
        yield path, server


@pytest.fixture(scope="module")
def hf_answer(llava_server):
    """HF transformers' greedy answer (8 tokens) and prompt length for "look" + IMAGE."""
    path, _ = llava_server
    processor = AutoProcessor.from_pretrained(path)
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text="<|im_start|>user\nlook\n<image><|im_end|>\n<|im_start|>assistant\n", images=[IMAGE],
                       return_tensors="pt")
    with torch.no_grad():
        ids = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(ids, skip_special_tokens=True), inputs["input_ids"].shape[1]


def test_data_url_image_matches_hf(llava_server, hf_answer):
    _, server = llava_server
    body = {"model": "llava", "messages": image_message(data_url(IMAGE)), "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == hf_answer[0]
    assert r.json()["usage"]["prompt_tokens"] == hf_answer[1]


def test_openai_client_chat_and_responses_with_a_base64_image(llava_server, hf_answer):
    _, server = llava_server
    client = server.client()
    chat = client.chat.completions.create(model="llava", messages=image_message(data_url(IMAGE)), max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.content == hf_answer[0]
    assert chat.usage.prompt_tokens == hf_answer[1]
    response = client.responses.create(
        model="llava", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "look"},
                                            {"type": "input_image", "image_url": data_url(IMAGE), "detail": "auto"}]}])
    assert response.output_text == hf_answer[0]  # "incomplete": max_output_tokens ends it
    assert response.usage.input_tokens == hf_answer[1]
    events = list(client.responses.create(
        model="llava", max_output_tokens=8, temperature=0, stream=True,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "look"},
                                            {"type": "input_image", "image_url": data_url(IMAGE)}]}]))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == hf_answer[0]


def test_allowed_file_and_host_images_answer_as_the_data_url(llava_server, hf_answer, media_dir, media_server):
    _, server = llava_server
    urls = [f"file://{media_dir}/allowed/cat.png", str(media_dir / "allowed" / "cat.png"),
            media_server.url + "/cat.png"]
    for url in urls:
        body = {"model": "llava", "messages": image_message(url), "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + CHAT, json=body, timeout=60)
        assert r.status_code == 200, (url, r.text)
        assert r.json()["choices"][0]["message"]["content"] == hf_answer[0], url


BOMB = "data:image/png;base64," + base64.b64encode(png_bytes(Image.new("1", (8200, 8200)))).decode()


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "not in --allowed-media-domains"),
    ("http://localhost/cat.png", "not in --allowed-media-domains (allowed: 127.0.0.1)"),
    ("file:///etc/passwd", "outside --allowed-local-media-path"),
    ("ESCAPE", "outside --allowed-local-media-path"),
    ("MISSING", "answered HTTP 404"),
    ("gopher://127.0.0.1/cat.png", "unsupported image URL scheme 'gopher'"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode the image"),
    ("data:image/png;base64,%%%", "not valid base64"),
    (BOMB, "8200x8200, over the limit of"),
], ids=["domain", "other-host", "path", "symlink", "404", "scheme", "not-image", "base64", "bomb"])
def test_bad_image_urls_are_400(llava_server, media_dir, media_server, url, message):
    _, server = llava_server
    url = {"ESCAPE": str(media_dir / "allowed" / "escape.png"), "MISSING": media_server.url + "/nope.png"}.get(url, url)
    r = httpx.post(server.url + CHAT, json={"model": "llava", "messages": image_message(url)}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "messages[0].content[1].image_url", error
    ok = httpx.post(server.url + CHAT, json={"model": "llava", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and it keeps serving


def test_too_many_images_and_bad_parts_are_400(llava_server):
    _, server = llava_server
    parts = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched.png"}}] * (IMAGE_LIMIT + 1)
    r = httpx.post(server.url + CHAT, json={"model": "llava", "messages": [{"role": "user", "content": parts}]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert f"over limit_mm_per_prompt={{'image': {IMAGE_LIMIT}}} (--limit-mm-per-prompt)" in r.json()["error"]["message"]
    bad = [({"type": "input_image", "image_url": data_url(IMAGE), "detail": "huge"}, "input[0].content[0].detail"),
           ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id"),
           ({"type": "input_audio", "input_audio": {}}, "input[0].content[0]"),
           ({"type": "hologram"}, "input[0].content[0]")]
    for part, param in bad:
        r = httpx.post(server.url + "/v1/responses", json={"model": "llava", "input": [
            {"role": "user", "content": [part]}]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (part, r.text)


def test_a_large_image_does_not_stall_the_server(llava_server):
    """The image's decoding and the HF processor (seconds for 8000x8000) run off the event loop: /v1/models keeps
    answering meanwhile."""
    _, server = llava_server
    big = data_url(Image.new("RGB", (8000, 8000), (120, 30, 200)))
    body = {"model": "llava", "messages": image_message(big), "max_tokens": 1}
    result = {}

    def send():
        start = time.monotonic()
        result["status"] = httpx.post(server.url + CHAT, json=body, timeout=120).status_code
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while thread.is_alive() and len(latencies) < 1000:
            start = time.monotonic()
            assert http.get("/v1/models").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join(timeout=120)
    assert result["status"] == 200
    assert result["elapsed"] > 2.0, result  # long enough that a stalled loop would show below
    assert len(latencies) >= 5 and max(latencies) < 1.0, (result, sorted(latencies)[-5:])
