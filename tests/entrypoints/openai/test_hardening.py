"""One regression test per bug a fuzzing run found (issue 13, point 1): each was a 500, a wrongly accepted request or
a dropped connection; each is now a 4xx in OpenAI's shape naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from surge.entrypoints.openai.guard import InternalErrorMiddleware, bearer_token
from surge.entrypoints.openai.limits import json_depth

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as client:
        yield client


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    return error


BIG = 1 << 64
# (path, body, param): integers beyond 64 bits reached the engine's msgpack message and broke it.
BIG_INTEGERS = [
    (CHAT, {"messages": MSG, "seed": BIG}, "seed"),
    (CHAT, {"messages": MSG, "seed": -BIG}, "seed"),
    (CHAT, {"messages": MSG, "seed": (1 << 63) - 1, "n": 2}, "seed"),  # seed + n - 1 overflows
    (CHAT, {"messages": MSG, "top_k": BIG}, "top_k"),
    (CHAT, {"messages": MSG, "stop_token_ids": [BIG]}, "stop_token_ids"),
    (CHAT, {"messages": MSG, "stop_token_ids": [300]}, "stop_token_ids"),  # beyond the vocabulary
    (CHAT, {"messages": MSG, "min_tokens": BIG}, "min_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": BIG}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "seed": BIG, "max_tokens": 2}, "seed"),
    (COMPLETIONS, {"prompt": [BIG], "max_tokens": 2}, "prompt"),
    (RESPONSES, {"input": "hi", "seed": BIG}, "seed"),
    (RESPONSES, {"input": "hi", "top_k": -BIG}, "top_k"),
    # Found by the fuzz test in CI: kv_transfer_params is opaque to the server but crosses to the engine.
    (CHAT, {"messages": MSG, "max_tokens": 2, "kv_transfer_params": {"type": BIG}}, "kv_transfer_params"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"a": [-BIG]}}, "kv_transfer_params"),
    (RESPONSES, {"input": "hi", "kv_transfer_params": {"a": {"b": BIG}}}, "kv_transfer_params"),
]


@pytest.mark.parametrize("path, body, param", BIG_INTEGERS, ids=[f"{i}" for i in range(len(BIG_INTEGERS))])
@pytest.mark.parametrize("stream", [False, True])
def test_integers_beyond_64_bits_are_400(http, path, body, param, stream):
    """Streamed too: it used to be a 200 whose stream carried the error."""
    check_error(http.post(path, json={**body, "stream": stream}), 400, param)


def test_the_largest_seed_that_fits_is_served(http):
    r = http.post(CHAT, json={"messages": MSG, "seed": (1 << 63) - 2, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_deep_nesting_is_400_without_recursion(http):
    deep = "[" * 5000 + "]" * 5000
    body = '{"messages": [{"role": "user", "content": "hi"}], "tools": ' + deep + "}"
    error = check_error(http.post(CHAT, content=body, headers={"Content-Type": "application/json"}), 400)
    assert error["code"] == "json_too_deep" and "5001" in error["message"]


def test_json_depth_counts_structure_not_strings():
    assert json_depth(b'{"a": "[[[[{{{{", "b": [[1], {"c": "\\"]]"}]}') == 3
    assert json_depth(b"[]") == 1 and json_depth(b'"x"') == 0


def test_body_over_the_limit_is_413(http):
    body = json.dumps({"prompt": "a" * (17 << 20), "max_tokens": 1})
    check_error(http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"}), 413)
    assert http.post(CHAT, json={"messages": MSG, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("kwarg", ["add_generation_prompt", "tokenize", "conversation", "chat_template", "tools"])
def test_template_kwargs_cannot_set_the_renderers_arguments(http, kwarg):
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 1, "chat_template_kwargs": {kwarg: "{{ 7 * 7 }}"}})
    check_error(r, 400, "chat_template_kwargs")


def test_request_chat_template_needs_the_servers_trust(http):
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 1, "chat_template": "{{ 7 * 7 }}"})
    assert "--trust-request-chat-template" in check_error(r, 400, "chat_template")["message"]
    r = http.post("/tokenize", json={"messages": MSG, "chat_template": "{{ 7 * 7 }}"})
    check_error(r, 400, "chat_template")


def test_template_kwargs_the_template_does_not_read_change_nothing(http):
    plain = http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    extra = http.post("/tokenize", json={"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}})
    assert extra.json()["tokens"] == plain


@pytest.mark.parametrize("text, param", [({"format": "json"}, "text.format"), ({"format": ["x"]}, "text.format"),
                                         ("json", "text"), ({"format": {"type": "yaml"}}, "text.format.type"),
                                         # OpenAI requires both name and schema here (Chat's schema is optional)
                                         ({"format": {"type": "json_schema"}}, "text.format.name"),
                                         ({"format": {"type": "json_schema", "schema": {}}}, "text.format.name"),
                                         ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
                                         ({"format": {"type": "json_schema", "name": "a b", "schema": {}}},
                                          "text.format.name"),
                                         ({"format": {"type": "json_schema", "name": 3, "schema": {}}},
                                          "text.format.name")])
def test_responses_text_format_must_be_an_object(http, text, param):
    check_error(http.post(RESPONSES, json={"input": "hi", "text": text}), 400, param)


def test_max_completion_tokens_zero_is_400(http):
    check_error(http.post(CHAT, json={"messages": MSG, "max_completion_tokens": 0}), 400, "max_completion_tokens")
    check_error(http.post(CHAT, json={"messages": MSG, "max_completion_tokens": 0, "max_tokens": 5}), 400,
                "max_completion_tokens")


@pytest.mark.parametrize("body, param", [
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop_token_ids": [5] * 257}, "stop_token_ids"),
    ({"n": 129}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_counts_and_lengths_are_bounded(http, body, param):
    check_error(http.post(CHAT, json={"messages": MSG, "max_tokens": 1, **body}), 400, param)


def test_lower_case_bearer_scheme_is_accepted(tiny_server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(f"{tiny_server.url}{CHAT}", json={"messages": MSG, "max_tokens": 1},
                       headers={"Authorization": f"{scheme} {tiny_server.api_key}"}, timeout=60)
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.post(f"{tiny_server.url}{CHAT}", json={"messages": MSG},
                   headers={"Authorization": f"Basic {tiny_server.api_key}"}, timeout=60)
    check_error(r, 401)
    assert bearer_token(b"bearer  k ") == b"k" and bearer_token(b"Bearer") is None


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_bodies_must_say_so(http, content_type):
    """A body a web page can send without the browser's preflight must not be served."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"messages": MSG, "max_tokens": 1}).encode()
    with httpx.Client(base_url=str(http.base_url), headers={k: v for k, v in http.headers.items()
                                                            if k.lower() == "authorization"}) as bare:
        r = bare.post(CHAT, content=body, headers=headers)
    check_error(r, 415)
    r = http.post(CHAT, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_500_keeps_the_connection_and_tells_nothing_of_the_inside():
    """Starlette's handler for Exception answered, then re-raised to uvicorn, which dropped the keep-alive
    connection without `Connection: close`: the client's next request on it failed."""
    async def boom(request):
        raise RuntimeError("secret internal detail")

    async def fine(request):
        from starlette.responses import PlainTextResponse
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/boom", boom), Route("/fine", fine)])
    app.add_middleware(InternalErrorMiddleware)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                          limits=httpx.Limits(max_connections=1)) as client:
            for _ in range(3):
                r = client.get("/boom")
                error = check_error(r, 500)
                assert "secret" not in r.text and "RuntimeError" not in r.text and error["code"] == "internal_error"
                assert r.headers.get("connection") != "close"
                assert client.get("/fine").text == "ok"  # on the same connection
    finally:
        server.should_exit = True
        thread.join(20)
