"""When the engine core process dies, the app says so: /health turns 503, in-flight streams end with an error
event, and new requests get a 503 in OpenAI's shape instead of hanging."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx

from surge.engine.async_llm import AsyncLLM
from surge.entrypoints.openai.app import build_app


def test_dead_core_is_reported(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(str(tiny_model_dir), max_model_len=512, kv_cache_memory=8 << 20)
    app = build_app(engine, ["tiny"])
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
            stream_task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not engine.output_processor.has_unfinished():
                await asyncio.sleep(0.01)
            os.kill(engine.core.proc.pid, signal.SIGKILL)
            streamed = (await stream_task).text
            health = await client.get("/health")
            after = await client.post("/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}]})
            return streamed, health, after

    try:
        streamed, health, after = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.core.shutdown()
    assert '"code":"engine_dead"' in streamed and streamed.rstrip().endswith("data: [DONE]")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert after.status_code == 503 and "died" in after.json()["error"]["message"]
