"""One registry of content-part types for every renderer: the Chat and Responses shapes of one conversation render
byte-identical prompts, and non-text parts get a clear 400."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from surge.engine.args import EngineArgs
from surge.engine.input_processor import InputProcessor, load_tokenizer
from surge.entrypoints.openai.content import PART_ALIASES, UNSUPPORTED_PARTS, content_text
from surge.entrypoints.openai.errors import APIError
from surge.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest, decode_request
from surge.entrypoints.openai.chat import ChatHandler
from surge.entrypoints.openai.responses import ResponsesHandler
from surge.entrypoints.openai.serving import OpenAIServing


@pytest.fixture(scope="module")
def serving(default_model_dir):
    """The real default model's tokenizer and ChatML template, without an engine process."""
    config = EngineArgs(default_model_dir, device="cpu").create_engine_config()
    tokenizer = load_tokenizer(default_model_dir)
    engine = SimpleNamespace(config=config, tokenizer=tokenizer, input_processor=InputProcessor(config, tokenizer),
                             dead_error=None)
    return OpenAIServing(engine, ["m"])


CHAT = {
    "messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One."}]},
        {"role": "assistant", "content": "Bleu."},
        {"role": "user", "content": "Another?"},
    ]
}
RESPONSES = {
    "instructions": "Answer in French.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."},
                                     {"type": "input_text", "text": "One."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Bleu.", "annotations": []}]},
        {"type": "message", "role": "user", "content": "Another?"},
    ],
}


def test_chat_and_responses_shapes_render_identical_prompts(serving):
    import msgspec
    chat = decode_request(msgspec.json.encode(CHAT), ChatCompletionRequest)
    responses = decode_request(msgspec.json.encode(RESPONSES), ResponsesRequest)
    chat_messages = serving.chat_messages(chat.messages)
    responses_messages = ResponsesHandler(serving).conversation(responses)
    assert chat_messages == responses_messages
    ip = serving.engine.input_processor
    chat_text = ip.render_chat_text(chat_messages)
    assert chat_text.encode() == ip.render_chat_text(responses_messages).encode()
    assert ChatHandler(serving).render(chat) == serving.render(responses_messages)
    # And the rendering is the template's own, on plain string contents.
    expected = serving.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour.\nOne."},
         {"role": "assistant", "content": "Bleu."}, {"role": "user", "content": "Another?"}],
        tokenize=False, add_generation_prompt=True)
    assert chat_text == expected


def test_string_input_equals_one_user_message(serving):
    handler = ResponsesHandler(serving)
    as_string = handler.conversation(ResponsesRequest(input="hi", instructions="be brief"))
    as_list = handler.conversation(ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_text",
                                                                                          "text": "hi"}]}],
                                                    instructions="be brief"))
    assert as_string == as_list == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("part_type", sorted(PART_ALIASES))
def test_every_text_alias_is_text(part_type):
    assert content_text([{"type": part_type, "text": "a"}, {"type": "text", "text": "b"}], "c") == "a\nb"


@pytest.mark.parametrize("part_type", sorted(UNSUPPORTED_PARTS))
def test_media_parts_are_a_clear_400(part_type):
    with pytest.raises(APIError) as e:
        content_text([{"type": "text", "text": "a"}, {"type": part_type}], "messages[1].content")
    assert e.value.status == 400 and e.value.param == "messages[1].content[1]"
    assert "not supported yet" in e.value.message and part_type in e.value.message


@pytest.mark.parametrize("content", [[{"text": "no type"}], ["a string part"], [{"type": "text", "text": 5}], 7])
def test_malformed_parts_are_400(content):
    with pytest.raises(APIError) as e:
        content_text(content, "messages[0].content")
    assert e.value.status == 400 and e.value.param.startswith("messages[0].content")
