"""One registry of content-part types for every renderer: the Chat and Responses shapes of one conversation render
byte-identical prompts, and non-text parts get a clear 400."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from surge.engine.args import EngineArgs
from surge.engine.input_processor import InputProcessor, load_tokenizer
from surge.entrypoints.openai.content import (IMAGE, PART_ALIASES, TEXT, UNSUPPORTED_PARTS, ImagePart,
                                             content_text)
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
    assert asyncio.run(ChatHandler(serving).render_prompt(chat)) == (serving.render(responses_messages), [])
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


@pytest.mark.parametrize("part_type", sorted(t for t, kind in PART_ALIASES.items() if kind == TEXT))
def test_every_text_alias_is_text(part_type):
    assert content_text([{"type": part_type, "text": "a"}, {"type": "text", "text": "b"}], "c") == "a\nb"


@pytest.mark.parametrize("part_type", sorted(UNSUPPORTED_PARTS))
def test_media_parts_are_a_clear_400(part_type):
    with pytest.raises(APIError) as e:
        content_text([{"type": "text", "text": "a"}, {"type": part_type}], "messages[1].content")
    assert e.value.status == 400 and e.value.param == "messages[1].content[1]"
    assert "not supported yet" in e.value.message and part_type in e.value.message


CHAT_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
RESPONSES_IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"}


@pytest.mark.parametrize("part", [CHAT_IMAGE, RESPONSES_IMAGE, {"type": "image_url", "image_url": "data:x"}])
def test_image_parts_of_both_apis_become_placeholders(part):
    images = []
    text = content_text([{"type": "text", "text": "look"}, part], "messages[0].content", images, "<image>")
    assert text == "look\n<image>"
    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
    assert images == [ImagePart(url, "messages[0].content[1].image_url")]


@pytest.mark.parametrize("part_type", sorted(t for t, kind in PART_ALIASES.items() if kind == IMAGE))
def test_image_parts_to_a_text_only_model_say_it_takes_no_images(part_type):
    with pytest.raises(APIError) as e:
        content_text([{"type": part_type, "image_url": "data:,"}], "input[0].content")
    assert e.value.status == 400 and e.value.param == "input[0].content[0]"
    assert "takes no image input" in e.value.message


@pytest.mark.parametrize("part, param, message", [
    ({"type": "input_image", "detail": "auto"}, "input[0].content[0].image_url", "must be a string"),
    ({"type": "input_image", "image_url": 5}, "input[0].content[0].image_url", "must be a string"),
    ({"type": "image_url", "image_url": {"url": None}}, "input[0].content[0].image_url.url", "must be a string"),
    ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id", "not supported"),
    ({**RESPONSES_IMAGE, "detail": "ultra"}, "input[0].content[0].detail", "'ultra' is invalid"),
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": 3}}, "input[0].content[0].detail", "invalid"),
])
def test_malformed_image_parts_are_400(part, param, message):
    with pytest.raises(APIError) as e:
        content_text([part], "input[0].content", [], "<image>")
    assert e.value.status == 400 and e.value.param == param and message in e.value.message


@pytest.mark.parametrize("content", [[{"text": "no type"}], ["a string part"], [{"type": "text", "text": 5}], 7])
def test_malformed_parts_are_400(content):
    with pytest.raises(APIError) as e:
        content_text(content, "messages[0].content")
    assert e.value.status == 400 and e.value.param.startswith("messages[0].content")
