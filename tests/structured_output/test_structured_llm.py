"""Structured output end to end on the default model through surge.LLM: every output is checked by an independent
validator (jsonschema, re.fullmatch, membership), greedy and sampled, batched, n > 1; a rejected schema is a
ValueError before anything runs; the reasoning gate constrains only what follows </think>."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from surge import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
ENGINE = {"kv_cache_memory": 1 << 27, "max_model_len": 512}


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, **ENGINE)


def _so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_greedy_and_sampled(llm):
    prompts = [f"Write a JSON record for customer number {i} of a paint shop." for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=_so(json=SCHEMA))
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=120,
                             structured_outputs=_so(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    outs = llm.generate(prompts * 2, [greedy] * 12 + [sampled] * 12, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured_output.grammars


def test_regex_choice_grammar_and_json_object(llm):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["positive", "negative", "neutral"]
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"\n'
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=_so(regex=phone)),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs=_so(choice=choices)),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=_so(grammar=gbnf)),
              SamplingParams(temperature=0, max_tokens=150, structured_outputs=_so(json_object=True))]
    prompts = ["Call us at", "Review: the film was dull. Sentiment:", "Is the sky green?", "A JSON object:"]
    phone_text, choice_text, grammar_text, object_text = _texts(llm.generate(prompts, params, use_tqdm=False))
    assert re.fullmatch(phone, phone_text), phone_text
    assert choice_text in choices
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", grammar_text), grammar_text
    assert isinstance(json.loads(object_text), dict), object_text


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                            structured_outputs=_so(regex=r"[A-Z][a-z]{2,8} (is|was) (big|small)"))
    (out,) = llm.generate("Describe an animal:", params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch(r"[A-Z][a-z]{2,8} (is|was) (big|small)", t) for t in texts), texts
    assert len(set(texts)) > 1  # four samples, each its own matcher and RNG


def test_rejected_schema_is_a_clear_value_error(llm):
    bad = SamplingParams(structured_outputs=_so(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(ValueError, match="structured_outputs.json is invalid: .*nope"):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    with pytest.raises(ValueError, match="(?s)structured_outputs.regex is invalid: .*unclosed"):
        llm.generate("x", SamplingParams(structured_outputs=_so(regex="(a|b")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured_output.grammars


def test_reasoning_gate(default_model_dir, llm):
    """With --reasoning-parser qwen3 the grammar waits for </think>: a prompt that closed its reasoning is constrained
    from the first token; one still inside it is not (the model writes freely, as it does without a grammar)."""
    gated = LLM(default_model_dir, reasoning_parser="qwen3", **ENGINE)
    choices = ["alpha", "omega"]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=_so(choice=choices))
    closed, still_open = _texts(gated.generate(["Pick one. <think>easy</think>", "Pick one. <think>"], params,
                                               use_tqdm=False))
    assert closed in choices
    free = _texts(llm.generate("Pick one. <think>", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False))
    assert still_open == free[0] and still_open not in choices
