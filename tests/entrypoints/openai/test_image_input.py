"""Chat Completions with images: `image_url` parts with data: URLs reach a multimodal model (the tiny LLaVA) and
answer as HF transformers does; other URLs and undecodable images are 400s naming the rule."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from remote_server import RemoteServer
from tiny_vlm import make_tiny_llava

CHAT = "/v1/chat/completions"


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    path = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    with RemoteServer(path, "--served-model-name", "llava", "--max-model-len", "256", "--kv-cache-memory",
                      str(16 << 20), "--dtype", "float32") as server:
        yield path, server


def test_data_url_image_matches_hf(llava_server):
    path, server = llava_server
    image = Image.fromarray(np.random.RandomState(5).randint(0, 255, (30, 20, 3), dtype=np.uint8))
    body = {"model": "llava", "messages": image_message(data_url(image)), "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    processor = AutoProcessor.from_pretrained(path)
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text="<|im_start|>user\nlook\n<image><|im_end|>\n<|im_start|>assistant\n", images=[image],
                       return_tensors="pt")
    with torch.no_grad():
        ids = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert r.json()["choices"][0]["message"]["content"] == processor.tokenizer.decode(ids, skip_special_tokens=True)
    assert r.json()["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "--allowed-media-domains"),
    ("file:///etc/passwd", "--allowed-local-media-path"),
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode the image"),
])
def test_bad_image_urls_are_400(llava_server, url, message):
    _, server = llava_server
    r = httpx.post(server.url + CHAT, json={"model": "llava", "messages": image_message(url)}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "messages[0].content[1].image_url"
    ok = httpx.post(server.url + CHAT, json={"model": "llava", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and it keeps serving
