"""`surge proxy` against stub instances on 127.0.0.1 (threads of this process, each its own uvicorn server): the
legs it sends, the bytes it relays, retries and 503s, the error event that ends a stream whose instance is lost,
plain balancing without prefill instances, the least-outstanding order, and the encoder leg (only for requests
with images; one that fails is counted and the request goes on)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from remote_server import free_port

from surge.disagg.instances import Pool
from surge.disagg.proxy import Proxy

PARAMS = b'{"do_remote_prefill": true,  "remote_block_ids": [[3, 4]], "transfer_id": "T"}'
EVENT = b'data: {"choices": [{"text": "x"}]}\n\n'


class Stub:
    """A prefill or decode instance that records what it is sent and answers at once."""

    def __init__(self, role: str) -> None:
        self.role, self.bodies = role, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.bodies.append(body)
        fields = json.loads(body) if body else {}
        if self.role == "encode":
            status = 400 if fields.get("user") == "bad" else 200
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"id": "e"}'})
            return
        if self.role == "prefill":
            answer, media = b'{"id": "p", "kv_transfer_params": ' + PARAMS + b"}", b"application/json"
        elif not fields.get("stream"):
            answer, media = b'{"id":  "d",\n "echo": ' + json.dumps(fields.get("kv_transfer_params")).encode() + \
                b"}", b"application/json"
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(3):
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            if fields.get("user") == "die":
                await send({"type": "http.response.body", "body": b'data: {"cho', "more_body": True})
                raise RuntimeError("the instance dies mid-stream")  # uvicorn drops the connection
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media)]})
        await send({"type": "http.response.body", "body": answer})


def serve(app) -> tuple[str, uvicorn.Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "a test server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


@pytest.fixture
def stack():
    servers = []

    def build(prefill: int = 1, dead_prefill: int = 0, decode: int = 1, encode: int = 0, dead_encode: int = 0):
        stubs = {"prefill": [Stub("prefill") for _ in range(prefill)], "decode": [Stub("decode") for _ in
                                                                              range(decode)],
                 "encode": [Stub("encode") for _ in range(encode)]}
        urls = {}
        for role, group in stubs.items():
            urls[role] = []
            for stub in group:
                url, server = serve(stub)
                servers.append(server)
                urls[role].append(url)
        dead = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_prefill)]  # nothing listens there
        dead_e = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_encode)]
        url, server = serve(Proxy(dead + urls["prefill"], urls["decode"], encode=dead_e + urls["encode"]).app)
        servers.append(server)
        return url, stubs
    yield build
    for server in servers:
        server.should_exit = True


def test_the_legs_and_the_relayed_bytes(stack):
    url, stubs = stack()
    client = b'{"prompt": "hi",  "max_tokens": 30, "temperature": 0}'
    answer = httpx.post(url + "/v1/completions", content=client, timeout=10)
    assert answer.status_code == 200
    [prefill_leg] = stubs["prefill"][0].bodies
    leg = json.loads(prefill_leg)
    assert leg["max_tokens"] == 1 and leg["stream"] is False and leg["kv_transfer_params"]["do_remote_decode"]
    assert len(leg["kv_transfer_params"]["transfer_id"]) == 32
    [decode_leg] = stubs["decode"][0].bodies
    assert b'"kv_transfer_params":' + PARAMS in decode_leg  # the prefill instance's bytes, spliced as they came
    assert json.loads(decode_leg) == {**json.loads(client), "kv_transfer_params": json.loads(PARAMS)}
    # The decode instance's answer, byte for byte (its odd spacing included).
    assert answer.content.startswith(b'{"id":  "d",\n "echo": ')


def test_a_prefill_instance_that_is_down_is_retried_on_another_then_503(stack):
    url, stubs = stack(prefill=1, dead_prefill=1)
    for _ in range(4):  # the dead one is first in line at least once; each time the other one serves
        assert httpx.post(url + "/v1/chat/completions", content=b'{"messages": []}', timeout=10).status_code == 200
    assert len(stubs["prefill"][0].bodies) == 4
    assert "surge_proxy:leg_retries_total{role=\"prefill\"}" in httpx.get(url + "/metrics").text
    url, _ = stack(prefill=0, dead_prefill=2)
    answer = httpx.post(url + "/v1/responses", content=b'{"input": "hi"}', timeout=10)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "server_error" and "prefill" in answer.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 503


def test_a_stream_whose_instance_is_lost_ends_with_an_error_event(stack):
    url, _ = stack()
    ok = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi", "stream": true}', timeout=10)
    assert ok.content == EVENT * 3 + b"data: [DONE]\n\n"  # relayed untouched
    lost = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi", "stream": true, "user": "die"}',
                      timeout=10)
    events = lost.content.split(b"\n\n")
    assert lost.content.startswith(EVENT * 3)  # the cut-off event never reaches the client
    assert json.loads(events[3].removeprefix(b"data: "))["error"]["code"] == "upstream_lost"


def test_without_prefill_instances_requests_pass_through_whole(stack):
    url, stubs = stack(prefill=0, decode=2)
    body = b'{"prompt": [1, 2, 3],   "n": 1, "max_tokens": 5}'
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", content=body, timeout=10).status_code == 200
    assert [len(s.bodies) for s in stubs["decode"]] == [2, 2]  # idle instances take turns
    assert all(b == body for s in stubs["decode"] for b in s.bodies)  # the client's bytes, exactly


def test_least_outstanding_first_and_a_failed_instance_last():
    pool = Pool("prefill", ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    a, b, c = pool.instances
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert pool.order()[0] is b
    b.failed_at = time.monotonic()
    assert [i.url for i in pool.order()] == [c.url, a.url, b.url]
    assert pool.order(exclude=c)[0] is a
    with pytest.raises(ValueError, match="--prefill 'nohost' must be"):
        Pool("prefill", ["nohost"])


IMAGE_CHAT = (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", '
              b'"image_url": {"url": "data:image/png;base64,AAAA"}}]}], "stream": true, "max_tokens": 5}')
IMAGE_RESPONSES = (b'{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}], '
                   b'"max_output_tokens": 5}')


def test_requests_with_images_go_to_the_encoder_first_and_others_never(stack):
    url, stubs = stack(encode=1)
    assert httpx.post(url + "/v1/chat/completions", content=IMAGE_CHAT, timeout=10).status_code == 200
    [encode_leg] = stubs["encode"][0].bodies
    assert json.loads(encode_leg) == {**json.loads(IMAGE_CHAT), "stream": False}  # the client's body, not streamed
    assert len(stubs["prefill"][0].bodies) == len(stubs["decode"][0].bodies) == 1
    assert httpx.post(url + "/v1/responses", content=IMAGE_RESPONSES, timeout=10).status_code == 200
    assert len(stubs["encode"][0].bodies) == 2
    text_only = [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "say \\"image_url\\""}]}'),
                 ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                          b'"text": "an input_image"}]}]}'),
                 ("/v1/completions", b'{"prompt": "\\"image_url\\""}'), ("/v1/responses", b'{"input": "hi"}')]
    for path, body in text_only:
        assert httpx.post(url + path, content=body, timeout=10).status_code == 200
    assert len(stubs["encode"][0].bodies) == 2
    assert len(stubs["decode"][0].bodies) == 6


def test_an_encoder_leg_that_fails_is_counted_and_the_request_goes_on(stack):
    url, stubs = stack(dead_encode=2)
    assert httpx.post(url + "/v1/chat/completions", content=IMAGE_CHAT, timeout=10).status_code == 200
    assert len(stubs["prefill"][0].bodies) == len(stubs["decode"][0].bodies) == 1
    assert "surge_proxy:encoder_fallbacks_total 1.0" in httpx.get(url + "/metrics").text
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and not any(health.json()["encode"].values())  # reported, not required


def test_an_encoder_instance_refusing_the_request_answers_the_client(stack):
    url, stubs = stack(encode=1)
    bad = IMAGE_CHAT[:-1] + b', "user": "bad"}'
    answer = httpx.post(url + "/v1/chat/completions", content=bad, timeout=10)
    assert answer.status_code == 400 and answer.content == b'{"id": "e"}'
    assert not stubs["prefill"][0].bodies and not stubs["decode"][0].bodies
