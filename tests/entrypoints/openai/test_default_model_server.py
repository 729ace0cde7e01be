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


def test_logprobs_cover_exactly_the_text(server):
    """The model ends its turn with <|im_end|>, an EOS the text leaves out: chat's and the Responses API's logprobs
    leave it out too (it still counts as a completion token), streamed as unstreamed."""
    client = server.client()
    common = dict(model="SmolLM2-135M-Instruct", temperature=0)
    chat = client.chat.completions.create(messages=QUESTION, max_tokens=48, logprobs=True, top_logprobs=2, **common)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    content = [(t.token, t.logprob) for t in choice.logprobs.content]
    assert "".join(token for token, _ in content) == choice.message.content
    assert len(content) == chat.usage.completion_tokens - 1
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    streamed = [(t.token, t.logprob) for chunk in client.chat.completions.create(
        messages=QUESTION, max_tokens=48, logprobs=True, top_logprobs=2, stream=True, **common)
        if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert streamed == content

    include = ["message.output_text.logprobs"]
    response = client.responses.create(input=QUESTION, max_output_tokens=48, include=include, top_logprobs=2,
                                       **common)
    assert response.output_text == choice.message.content
    assert [(t.token, t.logprob) for t in response.output[0].content[0].logprobs] == content
    events = list(client.responses.create(input=QUESTION, max_output_tokens=48, include=include, top_logprobs=2,
                                          stream=True, **common))
    deltas = [(t.token, t.logprob) for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert deltas == content
    assert [(t.token, t.logprob) for t in events[-1].response.output[0].content[0].logprobs] == content
