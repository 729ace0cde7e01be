"""The official openai client, sync and async, streaming and not, against a live server on a tiny random model.

Greedy outputs are checked against surge.LLM run offline on the same model (the server must not change them),
streamed text against the same request unstreamed.
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from surge import LLM, SamplingParams

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, max_model_len=512, kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    """HF transformers' greedy continuation of a text: (token ids, the text after each number of them)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def greedy(prompt: str, n: int) -> tuple[list[int], list[str]]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
        return out, [tokenizer.decode(out[:t], skip_special_tokens=True) for t in range(n + 1)]
    return greedy


@pytest.fixture(scope="module")
def reference(offline):
    """Greedy texts from the offline engine: (completion of PROMPT, chat reply to CONVERSATION), 24 tokens each."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    completion = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    chat = offline.chat(CONVERSATION, params, use_tqdm=False)[0].outputs[0].text
    return completion, chat


def test_models_health_version(tiny_server):
    client = tiny_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == 512
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200  # open without the key
    assert httpx.get(f"{tiny_server.url}/version").json()["version"]


def test_models_retrieve(tiny_server):
    client = tiny_server.client()
    for name in ("tiny", "tiny-alias"):
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "surge")
        assert model.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/gpt-4o")
    error = e.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "org/gpt-4o" in error["message"]


@pytest.mark.parametrize("temperature", [1e-38, 1e-6])
def test_tiny_temperature_is_greedy(tiny_server, hf_greedy, temperature):
    """Below 1e-5 a temperature is greedy: 1e-38 used to overflow to a NaN softmax and token 0 every time."""
    _, texts = hf_greedy(PROMPT, 16)
    out = tiny_server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=temperature,
                                                  extra_body={"ignore_eos": True})
    assert out.choices[0].text == texts[-1]


def test_stop_string_within_min_tokens_does_not_end_the_request(tiny_server, hf_greedy):
    tokens, texts = hf_greedy(PROMPT, 24)
    stop, min_tokens = texts[4][2:4], 8  # text of the first tokens
    assert len(stop) == 2

    def expected(min_tokens: int) -> tuple[str, str]:
        """Plain scan: the first token after min_tokens that completes a match ends the text before it."""
        for t in range(min_tokens + 1, len(tokens) + 1):
            begin = texts[t].find(stop, max(0, len(texts[t - 1]) - len(stop) + 1))
            if begin >= 0:
                return texts[t][:begin], "stop"
        return texts[-1], "length"

    assert expected(0)[1] == "stop" and len(expected(0)[0]) < len(texts[4])  # without min_tokens it ends early
    client = tiny_server.client()
    for n in (0, min_tokens):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], temperature=0,
                                        extra_body={"min_tokens": n, "ignore_eos": True})
        assert (out.choices[0].text, out.choices[0].finish_reason) == expected(n), n


def test_completions_sync(tiny_server, reference):
    client = tiny_server.client()
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
    assert out.choices[0].text == reference[0]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(PROMPT.encode())
    chunks = list(client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference[0]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_token_prompts_and_n(tiny_server, reference):
    client = tiny_server.client()
    ids = list(PROMPT.encode())  # the byte tokenizer: token id = byte
    out = client.completions.create(model="tiny", prompt=[ids, PROMPT], max_tokens=24, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text == reference[0]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, **GREEDY)
    assert out.choices[0].text == PROMPT + reference[0][:len(out.choices[0].text) - len(PROMPT)]


def test_completions_logprobs(tiny_server):
    out = tiny_server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the best one
    assert "".join(lp.tokens) == out.choices[0].text


def test_stop_string_streamed_and_not(tiny_server, reference):
    client = tiny_server.client()
    stop = reference[0][6:8]
    expected = reference[0][:reference[0].find(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop, stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_sync(tiny_server, reference):
    client = tiny_server.client()
    out = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24, **GREEDY)
    assert out.choices[0].message.content == reference[1]
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[1]
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_chat_logprobs_and_n(tiny_server):
    client = tiny_server.client()
    out = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=5, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=5, n=2, seed=3,
                                                 stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    unstreamed = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=5, n=2, seed=3)
    assert [texts[0], texts[1]] == [c.message.content for c in unstreamed.choices]


def test_responses_sync(tiny_server, reference):
    client = tiny_server.client()
    out = client.responses.create(model="tiny", instructions="You are terse.", input="Say hi.",
                                  max_output_tokens=24, **GREEDY)
    assert out.output_text == reference[1]  # the same conversation as the chat shape
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 24
    events = list(client.responses.create(model="tiny", instructions="You are terse.", input="Say hi.",
                                          max_output_tokens=24, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference[1]
    assert events[-1].response.output_text == reference[1]


def test_responses_stream_helper_completes(tiny_server, offline):
    """A response that ends on its own (a stop token here) completes; the client's stream helper accepts it."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stop_token = offline.chat(CONVERSATION, greedy, use_tqdm=False)[0].outputs[0].token_ids[2]
    expected = offline.chat(CONVERSATION, greedy.clone(stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop"
    client = tiny_server.client()
    with client.responses.stream(model="tiny", input=[{"role": "system", "content": "You are terse."},
                                                      {"role": "user", "content": [{"type": "input_text",
                                                                                    "text": "Say hi."}]}],
                                 temperature=0.0, extra_body={"stop_token_ids": [stop_token],
                                                              "ignore_eos": True}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas) == expected.text


def test_async_clients_all_apis(tiny_server, reference):
    async def main():
        client = tiny_server.async_client()
        completion = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY)
        chat = await client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24, **GREEDY)
        response = await client.responses.create(model="tiny", instructions="You are terse.", input="Say hi.",
                                                 max_output_tokens=24, **GREEDY)
        streamed = []
        async for c in await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True,
                                                       **GREEDY):
            streamed.append(c.choices[0].text)
        chat_streamed = []
        async for c in await client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=24,
                                                            stream=True, **GREEDY):
            chat_streamed.append(c.choices[0].delta.content or "")
        resp_streamed = []
        async for e in await client.responses.create(model="tiny", instructions="You are terse.", input="Say hi.",
                                                     max_output_tokens=24, stream=True, **GREEDY):
            if e.type == "response.output_text.delta":
                resp_streamed.append(e.delta)
        await client.close()
        return (completion.choices[0].text, chat.choices[0].message.content, response.output_text,
                "".join(streamed), "".join(chat_streamed), "".join(resp_streamed))

    texts = asyncio.run(asyncio.wait_for(main(), 120))
    assert texts == (reference[0], reference[1], reference[1], reference[0], reference[1], reference[1])


def test_tokenize_detokenize(tiny_server):
    h = tiny_server.headers
    tokens = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert tokens["tokens"] == list(PROMPT.encode()) and tokens["count"] == len(PROMPT)
    text = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=h).json()
    assert text["prompt"] == PROMPT
    chat = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": CONVERSATION}, headers=h).json()
    usage = tiny_server.client().chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


def test_api_key_is_required(tiny_server):
    import openai as oa
    bad = oa.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(oa.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {"message", "type", "param",
                                                                                            "code"}
    assert isinstance(tiny_server.client().models.list(), openai.pagination.SyncPage)
