"""The one registry of content-part types, consulted by every prompt renderer (Chat, Responses, tokenize).

Chat sends `text` parts, the Responses API `input_text` (and `output_text` for earlier assistant turns): all are
text. Chat's `image_url` parts with a data: URL are images for a multimodal model; other image parts, audio, video and
file parts (and images for a text-only model) get a clear 400.
"""
from __future__ import annotations

from typing import Any

from surge.entrypoints.openai.errors import bad_request
from surge.multimodal.media import image_from_url

TEXT = "text"

# Part type as a client sends it -> the kind Surge renders.
PART_ALIASES: dict[str, str] = {"text": TEXT, "input_text": TEXT, "output_text": TEXT}

# Part types of OpenAI's APIs that name a modality Surge does not take yet.
UNSUPPORTED_PARTS: dict[str, str] = {
    "image_url": "image", "input_image": "image", "image": "image",
    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
    "video_url": "video", "input_video": "video", "video": "video",
    "file": "file", "input_file": "file",
}

# Image parts a multimodal model takes (Chat's; the Responses API's input_image is not wired yet).
IMAGE_PARTS = ("image_url",)

# Parts of one message are joined with a newline, whichever API sent them, so every shape renders alike.
_PART_SEPARATOR = "\n"


def part_kind(part: Any, param: str) -> str:
    """The kind of one content part, or a 400 naming the part and what is allowed."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad_request(f"{param} must be an object with a string 'type'", param=param)
    part_type = part["type"]
    kind = PART_ALIASES.get(part_type)
    if kind is not None:
        return kind
    if part_type in UNSUPPORTED_PARTS:
        raise bad_request(f"{param}: content type {part_type!r} ({UNSUPPORTED_PARTS[part_type]} input) is not "
                          f"supported yet; only text parts are ({', '.join(PART_ALIASES)})",
                          param=param, code="unsupported_content_type")
    raise bad_request(f"{param}: unknown content type {part_type!r}; supported: {', '.join(PART_ALIASES)}",
                      param=param, code="unsupported_content_type")


def content_text(content: str | list | None, param: str, images: list | None = None, placeholder: str = "") -> str:
    """A message's content (a string, a list of parts, or null) as the text the chat template sees. images: a
    multimodal model's list, which takes the decoded image of each image part (its text: the model's placeholder);
    None: image parts are a 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if images is not None and isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
            images.append(_part_image(part, where))
            texts.append(placeholder)
            continue
        part_kind(part, where)  # every kind that passes is text
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    return _PART_SEPARATOR.join(texts)


def _part_image(part: dict, param: str):
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    try:
        return image_from_url(url)
    except ValueError as e:
        raise bad_request(f"{param}.image_url: {e}", param=f"{param}.image_url") from None
