"""Load on a tiny model: 200 concurrent streams all complete, 50 clients that hang up mid-stream get their requests
aborted; afterwards the KV cache is empty again (read through /metrics) and the server still answers."""
from __future__ import annotations

import asyncio

import httpx



def test_200_concurrent_streams_complete(tiny_server):
    async def one(client, i: int) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, 0
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=16, stream=True,
            stream_options={"include_usage": True}, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish, usage

    async def main():
        client = tiny_server.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(200)))
        finally:
            await client.close()

    before = tiny_server.metrics()
    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(results) == 200
    assert all(finish == "length" and usage == 16 and text for text, finish, usage in results)
    m = tiny_server.wait_idle()
    assert m["surge:kv_cache_usage_perc"] == 0.0
    assert (m["surge:num_requests_running"], m["surge:num_requests_waiting"]) == (0.0, 0.0)
    assert m["surge:generation_tokens_total"] - before["surge:generation_tokens_total"] == 200 * 16
    assert m["surge:request_success_total{length}"] - before.get("surge:request_success_total{length}", 0) == 200
    assert m["surge:time_to_first_token_seconds_count"] - before["surge:time_to_first_token_seconds_count"] == 200
    assert m["surge:e2e_request_latency_seconds_count"] - before["surge:e2e_request_latency_seconds_count"] == 200
    assert m["surge:inter_token_latency_seconds_count"] > before["surge:inter_token_latency_seconds_count"]


def test_50_disconnects_mid_stream_abort_and_free(tiny_server):
    max_tokens = 400  # far more than can be generated before the clients hang up

    async def hang_up(client: httpx.AsyncClient, i: int, path: str, body: dict) -> int:
        seen = 0
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 2:
                        break  # leaving the block closes the connection mid-stream
        return seen

    def body(i: int) -> tuple[str, dict]:
        common = {"model": "tiny", "stream": True, "ignore_eos": True}
        if i % 3 == 0:
            return "/v1/completions", {**common, "prompt": f"p{i}", "max_tokens": max_tokens}
        if i % 3 == 1:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"c{i}"}],
                                            "max_tokens": max_tokens}
        return "/v1/responses", {**common, "input": f"r{i}", "max_output_tokens": max_tokens}

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=tiny_server.headers, timeout=60) as client:
            return await asyncio.gather(*(hang_up(client, i, *body(i)) for i in range(50)))

    before = tiny_server.metrics()
    assert asyncio.run(asyncio.wait_for(main(), 60)) == [2] * 50
    m = tiny_server.wait_idle()
    assert m["surge:kv_cache_usage_perc"] == 0.0
    assert (m["surge:num_requests_running"], m["surge:num_requests_waiting"]) == (0.0, 0.0)
    # Every one was aborted: none finished, and together they made far fewer tokens than they asked for.
    finished = {k: v - before.get(k, 0.0) for k, v in m.items() if k.startswith("surge:request_success_total")}
    assert not any(finished.values()), finished
    assert m["surge:generation_tokens_total"] - before["surge:generation_tokens_total"] < 50 * max_tokens / 2
    # Still healthy and answering.
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    out = tiny_server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_non_streaming_disconnect_aborts(tiny_server):
    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=tiny_server.headers) as client:
            for i in range(5):  # 8 samples of 480 tokens each: seconds of work, given up after 0.3 s
                body = {"model": "tiny", "prompt": f"x{i}", "max_tokens": 480, "n": 8, "ignore_eos": True}
                try:
                    await client.post("/v1/completions", json=body, timeout=0.3)
                except httpx.TimeoutException:
                    pass  # the client gave up and closed the connection

    before = tiny_server.metrics()
    asyncio.run(asyncio.wait_for(main(), 30))
    m = tiny_server.wait_idle()
    assert m["surge:kv_cache_usage_perc"] == 0.0
    finished = {k: v - before.get(k, 0.0) for k, v in m.items() if k.startswith("surge:request_success_total")}
    assert not any(finished.values()), finished
