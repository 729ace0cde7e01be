"""Bad requests as raw HTTP: each gets a fitting 4xx in OpenAI's error shape, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (path, raw body, status, error param or None); bodies are bytes so malformed JSON reaches the server as is.
CASES = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b'{"messages": "hi"}', 400, "messages"),
    (CHAT, b'{"messages": [{"content": "hi"}]}', 400, "messages[0].role"),
    (CHAT, b'{"model": "tiny"}', 400, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 400, "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": true}', 400, "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}', 404, "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', 400, "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', 400, "n"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "n": 129}', 400, "n"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', 400, "top_p"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 3}', 400, "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400,
     "messages[0].content[0]"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}', 400,
     "messages[0].content[0]"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}', 400, "messages[0].content[0]"),
    (CHAT, b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role"),
    (CHAT, b'{"messages": []}', 400, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}', 400,
     "stream_options"),
    ("/v1/completions", b'{"prompt": "' + b"a" * 600 + b'"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, 2, 99999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 600}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 50}', 400, "logprobs"),
    ("/v1/completions", b'{"max_tokens": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),  # 0 needs echo
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1, "echo": true}', 400, "max_tokens"),
    ("/v1/responses", b'{"input": "hi", "top_logprobs": 21}', 400, "top_logprobs"),
    ("/v1/responses", b'{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}',
     400, "input[0].content[0]"),
    ("/v1/responses", b'{"input": [{"type": "web_search_call", "id": "1"}]}', 400, "input[0].type"),
    ("/v1/responses", b'{"input": "hi", "max_output_tokens": 1000}', 400, "max_output_tokens"),
    ("/v1/responses", b'{"input": "hi", "previous_response_id": "resp_1"}', 400, "previous_response_id"),
    ("/v1/responses", b'{"input": 5}', 400, "input"),
    ("/detokenize", b'{"tokens": [-1]}', 400, "tokens"),
    ("/v1/nothing-here", b"{}", 404, None),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers,
                      timeout=30) as client:
        yield client


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_request_gets_openai_error(http, path, body, status, param):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_bad_api_key_is_401(tiny_server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": tiny_server.api_key}):
        r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={"messages": MSG}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_server_still_serves_after_bad_requests(http):
    for path, body, _, _ in CASES:  # all of them again, back to back
        assert 400 <= http.post(path, content=body).status_code < 500
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
