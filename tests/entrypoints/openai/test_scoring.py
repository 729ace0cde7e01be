"""Scoring a text through /v1/completions, as lm-evaluation-harness and other scorers do: `echo` with `logprobs`
returns the prompt tokens' logprobs (the first one null), and `max_tokens: 0` scores without generating; for text
and token-id prompts, batched prompts, streamed and not. The reference is HF transformers on the same tiny model.
"""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The quick brown fox"
OTHER = "jumps over"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def token_text(tiny_model_dir):
    """A token id's text as HF decodes it alone."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return lambda token_id: tokenizer.decode([token_id])


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """token ids -> [len, V] float64 log-softmax of HF's logits: row i scores the token at position i + 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return logprobs


def ids_of(text: str) -> list[int]:
    return list(text.encode())  # the tiny models' byte tokenizer: token id = byte, no BOS


def check_prompt_logprobs(lp, ids: list[int], ref: torch.Tensor, num_top: int, token_text) -> None:
    """The first len(ids) entries of a choice's logprobs score the prompt as HF does."""
    assert lp.tokens[:len(ids)] == [token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOLERANCE), i
        top_values, top_ids = ref[i - 1].topk(num_top)
        expected = {token_text(t): v for t, v in zip(top_ids.tolist(), top_values.tolist())}
        assert lp.top_logprobs[i].keys() == expected.keys(), i
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(expected.values()), abs=TOLERANCE)


def test_echo_max_tokens_zero_scores_a_text_prompt(tiny_server, hf_logprobs, token_text):
    out = tiny_server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                                  temperature=0)
    [choice] = out.choices
    ids = ids_of(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)  # nothing generated
    assert lp.text_offset == list(range(len(PROMPT)))
    check_prompt_logprobs(lp, ids, hf_logprobs(ids), 2, token_text)


def test_echo_token_id_prompts_batched_with_one_generated_token(tiny_server, hf_logprobs, token_text):
    """lm-evaluation-harness's shape: token-id prompts, several per request, max_tokens=1, logprobs=1."""
    prompts = [ids_of(PROMPT), ids_of(OTHER), ids_of(PROMPT + " " + OTHER)]
    out = tiny_server.client().completions.create(model="tiny", prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 3
    for ids, choice in zip(prompts, out.choices):
        ref = hf_logprobs(ids)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1
        check_prompt_logprobs(lp, ids, ref, 1, token_text)
        greedy = int(ref[-1].argmax())
        assert choice.text == bytes(ids).decode() + token_text(greedy)
        assert lp.tokens[-1] == token_text(greedy)
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1, greedy].item(), abs=TOLERANCE)


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_logprobs_streamed_equal_unstreamed(tiny_server, max_tokens):
    client = tiny_server.client()
    kwargs = dict(model="tiny", prompt=[PROMPT, ids_of(OTHER)], max_tokens=max_tokens, echo=True, logprobs=2,
                  temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    streamed = {0: ([], [], ""), 1: ([], [], "")}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            tokens, logprobs, text = streamed[c.index]
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
            streamed[c.index] = (tokens, logprobs, text + c.text)
    for c in whole.choices:
        tokens, logprobs, text = streamed[c.index]
        assert (tokens, text) == (c.logprobs.tokens, c.text)
        assert logprobs[0] is None and logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:])


def test_max_tokens_zero_needs_echo(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/completions", headers=tiny_server.headers,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens" and "echo" in r.json()["error"]["message"]
