"""Prefill/decode disaggregation end to end on the default model: a prefill instance, a decode instance and
`surge proxy`, each its own process on 127.0.0.1, driven by the official openai client. The reference is a single
plain instance: greedy outputs must be identical for all three APIs, streamed and not; the decode instance's
metrics show it computed one prompt token per request (the last, whose logits give the first output token: the
transfer supplies every other); instances killed mid-way give an error event or OpenAI-shaped 503s, never a hang,
and the proxy serves again once an instance is back."""
from __future__ import annotations

import json
import time
from unittest import mock

import httpx
import openai
import pytest
import remote_server
from remote_server import RemoteServer
from serving_cluster import ProxyProcess, kill, start_side_by_side, stop_cluster

MODEL = "SmolLM2-135M-Instruct"
SERVE = ("--max-model-len", "2048", "--kv-cache-memory", str(256 << 20))
TIMEOUT_S = 4.0  # the prefill side's --kv-transfer-timeout
QUESTIONS = ["What is the capital of France? Answer in one sentence, please."]
PROMPT = "The history of the printing press began when"


def _connector(role: str) -> str:
    return json.dumps({"kv_connector": "MooncakeTransferConnector", "kv_role": role})


def start_prefill(port: int | None = None) -> RemoteServer:
    args = (*SERVE, "--kv-transfer-config", _connector("kv_producer"), "--kv-transfer-timeout", str(TIMEOUT_S))
    if port is None:
        return RemoteServer(None, *args)
    with mock.patch.object(remote_server, "free_port", return_value=port):
        return RemoteServer(None, *args)


@pytest.fixture(scope="module")
def cluster():
    single, prefill, decode = start_side_by_side(
        lambda: RemoteServer(None, *SERVE), start_prefill,
        lambda: RemoteServer(None, *SERVE, "--kv-transfer-config", _connector("kv_consumer")))
    proxy = ProxyProcess("--prefill", prefill.url, "--decode", decode.url)
    state = {"single": single, "prefill": prefill, "decode": decode, "proxy": proxy}
    try:
        yield state
    finally:  # the instances as they are then: a test may have replaced one
        stop_cluster(proxy, [state[name] for name in ("decode", "prefill", "single")])


def run_all(client: openai.OpenAI) -> dict[str, str]:
    """Every API, streamed and not, greedy: the texts."""
    out = {}
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        chat = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
        out[f"chat{i}"] = client.chat.completions.create(**chat).choices[0].message.content
        out[f"chat{i}-stream"] = "".join(c.choices[0].delta.content or "" for c in
                                         client.chat.completions.create(**chat, stream=True) if c.choices)
        out[f"responses{i}"] = client.responses.create(model=MODEL, input=messages, max_output_tokens=12,
                                                       temperature=0).output_text
        out[f"responses{i}-stream"] = "".join(e.delta for e in client.responses.create(
            model=MODEL, input=messages, max_output_tokens=12, temperature=0, stream=True)
            if e.type == "response.output_text.delta")
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    out["completion"] = client.completions.create(**completion).choices[0].text
    out["completion-stream"] = "".join(c.choices[0].text for c in
                                       client.completions.create(**completion, stream=True) if c.choices)
    return out


def _computed_prompt_tokens(metrics: dict[str, float]) -> float:
    """Prompt tokens the instance computed: its prompt tokens less those served by its prefix cache and by the KV
    connector (the transfer)."""
    return (metrics["surge:prompt_tokens_total"] - metrics["surge:prefix_cache_hits_total"]
            - metrics["surge:external_prefix_cache_hits_total"])


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


def test_greedy_outputs_match_a_single_instance_and_the_prompt_is_not_recomputed(cluster):
    reference = run_all(cluster["single"].client())
    assert all(reference.values()), reference
    decode = cluster["decode"]
    before = decode.metrics()
    got = run_all(cluster["proxy"].client())
    after = decode.metrics()
    assert got == reference
    num_requests = len(got)
    # Each request's prompt came from the prefill instance but for its last token.
    assert _computed_prompt_tokens(after) - _computed_prompt_tokens(before) == num_requests
    assert after["surge:external_prefix_cache_hits_total"] > before["surge:external_prefix_cache_hits_total"]
    assert after["surge:kv_connector_failures_total"] == 0
    # Every read was notified: the prefill instance's blocks are all back, none by the timeout.
    prefill = cluster["prefill"]
    _wait_for(lambda: prefill.metrics()["surge:kv_cache_usage_perc"] == 0.0, TIMEOUT_S / 2,
              "the prefill instance freed its blocks")
    assert prefill.metrics()["surge:kv_connector_failures_total"] == 0


def test_the_proxy_answers_its_own_endpoints(cluster):
    proxy = cluster["proxy"]
    assert [m.id for m in proxy.client().models.list().data] == [MODEL]
    assert httpx.get(proxy.url + "/health", timeout=10).json()["status"] == "ok"
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert 'surge_proxy:requests_total{api="chat",outcome="relayed"}' in metrics
    bad = httpx.post(proxy.url + "/v1/completions", content=b"[1, 2]", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_killed_prefill_instance_gives_503s_and_serving_resumes_once_it_is_back(cluster):
    proxy, prefill = cluster["proxy"], cluster["prefill"]
    port = prefill.port
    kill(prefill)
    client = proxy.client()
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert e.value.status_code == 503 and "prefill" in e.value.message
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
    cluster["prefill"] = start_prefill(port)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert text == cluster["single"].client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                                                 temperature=0).choices[0].text


def test_a_decode_instance_killed_mid_stream_ends_the_stream_with_an_error(cluster):
    proxy, prefill, decode = cluster["proxy"], cluster["prefill"], cluster["decode"]
    stream = proxy.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            received += 1
            if received == 3:
                kill(decode)
            assert received < 1000, "the stream went on after its decode instance was killed"
    assert "lost" in str(e.value)
    # The prefill instance's blocks are freed (read before the kill, or by the timeout), never leaked.
    _wait_for(lambda: prefill.metrics()["surge:kv_cache_usage_perc"] == 0.0, TIMEOUT_S + 5,
              "the prefill instance freed its blocks")
    with pytest.raises(openai.APIStatusError) as e:
        proxy.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
    assert e.value.status_code == 503 and "decode" in e.value.message
