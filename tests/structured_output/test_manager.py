"""The manager on a byte tokenizer (one token per character), against a plain reference: for a finite language, the
tokens allowed after a prefix are the next characters of the language's strings that extend it, and EOS once the
prefix is itself in the language. Rejected grammars are ValueErrors naming the field and llguidance's reason."""
from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, byte_tokenizer

from surge.core.scheduler_output import ScheduledRequest, SchedulerOutput
from surge.kernels.token_bitmask import unpack_bitmask
from surge.sampling_params import SamplingParams, StructuredOutputsParams
from surge.structured_output.manager import StructuredOutputManager
from surge.structured_output.reasoning import REASONING_MARKERS

EOS = 2


def _manager(reasoning=None) -> StructuredOutputManager:
    return StructuredOutputManager(byte_tokenizer, VOCAB, (EOS,), reasoning, num_threads=2)


def _add(manager, rid: str, prompt: list[int] | None = None, **so) -> None:
    grammar = manager.compile(prompt or [5], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    manager.add(rid, grammar)


def _step(*rids: str) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[ScheduledRequest(rid, 0, 1, True) for rid in rids])


def _allowed(manager, out: SchedulerOutput) -> dict[str, set[int]]:
    mask = manager.bitmask(out)
    if mask is None:
        return {}
    words = torch.frombuffer(bytearray(mask.bitmask), dtype=torch.int32).view(len(mask.request_ids), -1)
    rows = unpack_bitmask(words, VOCAB)
    return {rid: set(rows[i].nonzero().flatten().tolist()) for i, rid in enumerate(mask.request_ids)}


def _reference(language: list[str], prefix: str) -> set[int]:
    allowed = {ord(s[len(prefix)]) for s in language if s.startswith(prefix) and len(s) > len(prefix)}
    return allowed | ({EOS} if prefix in language else set())


@pytest.mark.parametrize("so, language", [
    ({"choice": ["cat", "car", "dog", "do"]}, ["cat", "car", "dog", "do"]),
    ({"regex": r"(ab|ac)d?"}, ["ab", "ac", "abd", "acd"]),
    ({"grammar": 'start: "x" mid "z"\nmid: "y" | "yy"\n'}, ["xyz", "xyyz"]),
], ids=["choice", "regex", "lark"])
def test_masks_follow_the_language(so, language):
    manager = _manager()
    _add(manager, "r", **so)
    # Walk every prefix of every string: the mask at each point is exactly the reference's.
    for target in language:
        manager.remove(["r"])
        _add(manager, "r", **so)
        for i in range(len(target) + 1):
            assert _allowed(manager, _step("r"))["r"] == _reference(language, target[:i]), (target, i)
            if i < len(target):
                manager.advance({"r": [ord(target[i])]})
        manager.advance({"r": [EOS]})  # a complete grammar takes the EOS that ends the request


def test_several_tokens_per_step_and_rows_in_step_order():
    manager = _manager()
    _add(manager, "a", choice=["hello", "help"])
    _add(manager, "b", regex="[0-9]+")
    manager.advance({"a": [ord(c) for c in "hel"], "b": [ord("7")], "unconstrained": [9]})
    got = _allowed(manager, _step("b", "unconstrained", "a"))
    assert list(got) == ["b", "a"]  # only constrained rows, in the step's order
    assert got["a"] == {ord("l"), ord("p")}
    assert got["b"] == {ord(c) for c in "0123456789"} | {EOS}


def test_finished_grammar_allows_only_eos():
    manager = _manager()
    _add(manager, "r", choice=["ok"])
    manager.advance({"r": [ord("o"), ord("k")]})
    assert _allowed(manager, _step("r"))["r"] == {EOS}


def test_json_object_and_schema_start_with_a_brace():
    manager = _manager()
    _add(manager, "o", json_object=True)
    _add(manager, "s", json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
         disable_any_whitespace=True)
    assert _allowed(manager, _step("o", "s")) == {"o": {ord("{")}, "s": {ord("{")}}
    manager.advance({"o": [ord("{")], "s": [ord("{")]})
    whitespace = {ord(" ")}  # the byte tokenizer spells tab, newline and CR as <9> <10> <13>
    assert _allowed(manager, _step("o", "s")) == {"o": {ord('"'), ord("}")} | whitespace, "s": {ord('"')}}
    manager.advance({"s": [ord(c) for c in '"a":']})
    assert _allowed(manager, _step("s"))["s"] == {ord(c) for c in "-0123456789"}


def test_unconstrained_steps_have_no_mask():
    manager = _manager()
    assert manager.bitmask(_step("x")) is None
    _add(manager, "r", regex="a")
    assert manager.bitmask(SchedulerOutput(scheduled=[ScheduledRequest("r", 0, 4, False)])) is None  # a prefill chunk


@pytest.mark.parametrize("so, problem", [
    ({"regex": "[a-z"}, "structured_outputs.regex is invalid: .*unclosed character class"),
    ({"grammar": "start: foo\n"}, "structured_outputs.grammar is invalid: .*unknown name"),
    ({"json": {"type": "frob"}}, "structured_outputs.json is invalid: .*frob"),
    ({"json": "{not json"}, "structured_outputs.json is invalid"),
    ({"json": "[1, 2]"}, "structured_outputs.json is invalid: a JSON schema is an object"),
], ids=["regex", "grammar", "schema", "json-text", "not-an-object"])
def test_rejected_grammars_are_clear_value_errors(so, problem):
    with pytest.raises(ValueError, match="(?s)" + problem):
        _add(_manager(), "r", **so)


def test_reasoning_gate_holds_the_grammar_until_the_closing_marker():
    manager = _manager(REASONING_MARKERS["qwen3"])
    _add(manager, "r", [ord(c) for c in "Q: <think>"], choice=["yes", "no"])
    _add(manager, "closed", [ord(c) for c in "<think></think>"], choice=["yes", "no"])
    assert list(_allowed(manager, _step("r", "closed"))) == ["closed"]  # r is still reasoning: no mask
    manager.advance({"r": [ord(c) for c in "hmm </thi"]})
    assert _allowed(manager, _step("r")) == {}
    manager.advance({"r": [ord(c) for c in "nk>"]})  # the marker spans two steps
    assert _allowed(manager, _step("r"))["r"] == {ord("y"), ord("n")}
    manager.advance({"r": [ord("y")]})
    assert _allowed(manager, _step("r"))["r"] == {ord("e")}


@pytest.mark.parametrize("prompt, reasoning", [("Q:<think>", True), ("Q:</think>", False), ("Q:", False),
                                               ("<think>a</think>Q:<think>", True)])
def test_prompt_decides_the_reasoning_gate(prompt, reasoning):
    """deepseek_v3 / deepseek_v4: the grammar waits for </think> only when the prompt left the reasoning open
    (V3.1 / V4 thinking mode); a chat-mode prompt, or one with no marker, is constrained from the first token."""
    manager = _manager(REASONING_MARKERS["deepseek_v4"])
    _add(manager, "r", [ord(c) for c in prompt], choice=["yes", "no"])
    assert _allowed(manager, _step("r")) == ({} if reasoning else {"r": {ord("y"), ord("n")}})
    if reasoning:
        manager.advance({"r": [ord(c) for c in "hmm</think>"]})
        assert _allowed(manager, _step("r"))["r"] == {ord("y"), ord("n")}


def test_waits_only_for_constrained_tokens_in_flight():
    manager = _manager()
    _add(manager, "r", regex="a+")
    assert manager.waits_for(_step("r", "x"), _step("r"))
    assert not manager.waits_for(_step("x"), _step("r", "x"))
    assert not manager.waits_for(_step("r"), _step("x"))


def test_requests_of_one_grammar_keep_their_own_state():
    """The second request of a grammar starts from a copy of the first's compiled matcher, not from its state."""
    manager = _manager()
    _add(manager, "a", choice=["xy", "xz"])
    manager.advance({"a": [ord("x")]})
    _add(manager, "b", choice=["xy", "xz"])
    assert _allowed(manager, _step("a", "b")) == {"a": {ord("y"), ord("z")}, "b": {ord("x")}}


def test_min_tokens_is_refused_with_a_grammar():
    """A completed grammar allows EOS alone, which min_tokens masks too: no token would be left to sample."""
    with pytest.raises(ValueError, match="min_tokens=3 is invalid: must be 0 with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert SamplingParams(min_tokens=3).min_tokens == 3


def test_a_mask_outlives_the_next_step():
    """Masks are read in place (the runner's upload runs with the step): the next step's fill must not overwrite the
    mask of the step before, which may still be on its way to the device."""
    manager = _manager()
    _add(manager, "r", choice=["ab"])
    first = manager.bitmask(_step("r"))
    before = bytes(first.bitmask)
    manager.advance({"r": [ord("a")]})
    assert _allowed(manager, _step("r"))["r"] == {ord("b")}
    assert bytes(first.bitmask) == before
    rows = unpack_bitmask(torch.frombuffer(bytearray(before), dtype=torch.int32).view(1, -1), VOCAB)
    assert set(rows[0].nonzero().flatten().tolist()) == {ord("a")}


def test_masks_filled_in_the_background_are_the_same():
    """fill_in_background gives the masks bitmask gives, while the calling thread runs Python meanwhile."""
    so = {"json": {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"]}}
    sync, background = _manager(), _manager()
    background.fills_in_background = True  # whatever the cores of this machine
    for m in (sync, background):
        _add(m, "p", **so)
        _add(m, "q", regex="[0-9]{2}")
    for text in ('{"a":"yz"}', "42"):
        for i in range(len(text) + 1):
            step = _step("q", "p")
            wait = background.fill_in_background(step)
            busy = sum(range(10_000))  # the engine processes the previous step's outputs here
            got, want = wait(), sync.bitmask(step)
            assert busy and got.request_ids == want.request_ids == ["q", "p"]
            assert bytes(got.bitmask) == bytes(want.bitmask)
            if i < len(text):
                rid = "p" if text.startswith("{") else "q"
                for m in (sync, background):
                    m.advance({rid: [ord(text[i])]})
    assert background.fill_in_background(_step("x"))() is None  # no constrained row
