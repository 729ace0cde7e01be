"""The default model (SmolLM2-135M-Instruct) behind `surge serve` with no model argument: a few short greedy
requests through the official client, all three APIs, sync and async, streamed and not. The reference is the
world: the model knows the capital of France."""
from __future__ import annotations

import asyncio

import pytest

from remote_server import RemoteServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with RemoteServer(None, "--max-model-len", "2048", "--kv-cache-memory", str(256 << 20)) as s:
        yield s


def test_served_under_its_directory_name(server):
    assert [m.id for m in server.client().models.list().data] == ["SmolLM2-135M-Instruct"]


def test_sync_clients(server):
    client = server.client()
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12,
                                          temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           max_tokens=4, temperature=0)
    assert "Paris" in completion.choices[0].text
    response = client.responses.create(model="SmolLM2-135M-Instruct", input=QUESTION, max_output_tokens=12,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content  # one conversation, one prompt
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_async_clients_streaming(server):
    async def main():
        client = server.async_client()
        deltas = []
        async for event in await client.responses.create(model="SmolLM2-135M-Instruct", input=QUESTION,
                                                         max_output_tokens=12, temperature=0, stream=True):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
        chunks = []
        async for chunk in await client.completions.create(model="SmolLM2-135M-Instruct",
                                                           prompt="The capital of France is", max_tokens=4,
                                                           temperature=0, stream=True):
            chunks.append(chunk.choices[0].text)
        chat = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION,
                                                    max_tokens=12, temperature=0)
        await client.close()
        return "".join(deltas), last, "".join(chunks), chat.choices[0].message.content

    text, last, completion, chat = asyncio.run(asyncio.wait_for(main(), 120))
    assert "Paris" in text and "Paris" in completion
    assert text == chat == last.response.output_text
    assert last.type in ("response.completed", "response.incomplete")
