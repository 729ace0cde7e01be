"""The proxy's bodies: a spliced body is, to a JSON parser (the standard library's, the reference), the client's
object with exactly the routed fields changed, while every value the proxy does not route on keeps its bytes; the
baseline codec of the benchmark produces the same objects."""
from __future__ import annotations

import json

import pytest

from surge.bench.proxy import ParsedBodies
from surge.disagg.bodies import RawBodies

# Bytes a re-encoder would change: an exponent, an escaped non-ASCII letter, spacing inside a nested object.
CLIENT = (b'{"model": "m", "prompt": "caf\\u00e9 au lait", "temperature": 0.0e0, "max_tokens": 40, "stream": true,'
          b' "stream_options": {"include_usage": true}, "min_tokens": 5, "user":   {"a" :  [1, 2]}}')
PARAMS = b'{"do_remote_prefill": true, "remote_block_ids": [[1, 2, 3]], "transfer_id": "t-1"}'


@pytest.mark.parametrize("codec", [RawBodies(), ParsedBodies()], ids=["raw", "parsed"])
def test_the_legs_change_only_the_routed_fields(codec):
    route = codec.parse(CLIENT, "completions")
    assert route.stream and route.split
    client = json.loads(CLIENT)
    prefill = json.loads(codec.prefill_body(route, "completions", "xyz"))
    expected = {**client, "max_tokens": 1, "stream": False, "min_tokens": 0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "xyz"}}
    del expected["stream_options"]
    assert prefill == expected
    answer = b'{"id": "cmpl-1", "choices": [], "kv_transfer_params": ' + PARAMS + b"}"
    decode = json.loads(codec.decode_body(route, codec.transfer_params(answer)))
    assert decode == {**client, "kv_transfer_params": json.loads(PARAMS)}


def test_passthrough_keeps_the_bytes_of_what_it_does_not_route_on():
    codec = RawBodies()
    route = codec.parse(CLIENT, "chat")
    body = codec.prefill_body(route, "chat", "xyz")
    for untouched in (b'"prompt":"caf\\u00e9 au lait"', b'"temperature":0.0e0', b'"user":{"a" :  [1, 2]}'):
        assert untouched in body
    assert json.loads(body)["max_completion_tokens"] == 1 and json.loads(body)["max_tokens"] == 1
    params = codec.transfer_params(b'{"kv_transfer_params": ' + PARAMS + b', "usage": {}}')
    assert params == PARAMS  # the prefill instance's bytes, as they came
    assert PARAMS in codec.decode_body(route, params)
    assert codec.transfer_params(b'{"kv_transfer_params": null}') is None
    assert codec.transfer_params(b'{"id": "x"}') is None
    assert json.loads(codec.prefill_body(codec.parse(b'{"input": "hi"}', "responses"), "responses",
                                         "t"))["max_output_tokens"] == 1


@pytest.mark.parametrize("prompt, split", [(b'"one"', True), (b"[1, 2, 3]", True), (b'["a", "b"]', False),
                                           (b"[[1, 2], [3]]", False)])
def test_only_one_prompt_and_one_sample_are_split(prompt, split):
    for codec in (RawBodies(), ParsedBodies()):
        assert codec.parse(b'{"prompt": ' + prompt + b"}", "completions").split is split
        assert not codec.parse(b'{"prompt": ' + prompt + b', "n": 2}', "completions").split


def test_a_body_that_is_not_an_object_is_refused():
    for bad in (b"[1]", b"{", b'"x"'):
        with pytest.raises(ValueError):
            RawBodies().parse(bad, "completions")
