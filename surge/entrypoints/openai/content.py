"""The one registry of content-part types, consulted by every prompt renderer (Chat, Responses, tokenize).

Chat sends `text` parts, the Responses API `input_text` (and `output_text` for earlier assistant turns): all are
text. Images come as Chat's `image_url` ({"url": ..., "detail": ...}) and the Responses API's `input_image`
({"image_url": "...", "detail": ...}) parts: a multimodal model takes them (loaded later, off the event loop, by
`load_images`); a text-only model answers a 400 saying it takes no images. Audio, video and file parts, and unknown
types, get a clear 400 too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from surge.entrypoints.openai.errors import bad_request
from surge.multimodal.media import MediaConnector

TEXT = "text"
IMAGE = "image"

# Part type as a client sends it -> the kind Surge renders.
PART_ALIASES: dict[str, str] = {"text": TEXT, "input_text": TEXT, "output_text": TEXT,
                                "image_url": IMAGE, "input_image": IMAGE}

# Part types of OpenAI's APIs that name a modality Surge does not take yet.
UNSUPPORTED_PARTS: dict[str, str] = {
    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
    "video_url": "video", "input_video": "video", "video": "video",
    "file": "file", "input_file": "file",
}

# OpenAI's `detail` values: accepted and not acted on, since the model's own processor sets the resolution.
IMAGE_DETAILS = ("auto", "low", "high")

# Parts of one message are joined with a newline, whichever API sent them, so every shape renders alike.
_PART_SEPARATOR = "\n"


@dataclass(frozen=True)
class ImagePart:
    """An image part as the client sent it, its shape checked; the image itself is loaded later (load_images)."""
    url: str
    param: str  # where its URL was in the request: a refusal names it


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
                          f"supported yet; supported: {', '.join(PART_ALIASES)}",
                          param=param, code="unsupported_content_type")
    raise bad_request(f"{param}: unknown content type {part_type!r}; supported: {', '.join(PART_ALIASES)}",
                      param=param, code="unsupported_content_type")


def content_text(content: str | list | None, param: str, images: list[ImagePart] | None = None,
                 placeholder: str = "") -> str:
    """A message's content (a string, a list of parts, or null) as the text the chat template sees. images: a
    multimodal model's list, which takes each image part (its text: the model's placeholder); None: the model takes
    no images, and an image part is a 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if part_kind(part, where) == IMAGE:
            if images is None:
                raise bad_request(f"{where}: this model takes no image input; image parts ({part['type']!r}) need a "
                                  "multimodal model", param=where, code="unsupported_content_type")
            images.append(image_part(part, where))
            texts.append(placeholder)
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    return _PART_SEPARATOR.join(texts)


def image_part(part: dict, param: str) -> ImagePart:
    """Chat's {"type": "image_url", "image_url": {"url": ..., "detail": ...}} (or the URL as a string) and the
    Responses API's {"type": "input_image", "image_url": "...", "detail": ...}."""
    url, detail = part.get("image_url"), part.get("detail")
    where = f"{param}.image_url"
    if isinstance(url, dict) and part["type"] == "image_url":
        url, detail, where = url.get("url"), url.get("detail"), f"{where}.url"
    if url is None and part.get("file_id") is not None:
        raise bad_request(f"{param}.file_id: uploaded files are not supported; send the image as image_url (a data: "
                          "URL)", param=f"{param}.file_id", code="unsupported_content_type")
    if not isinstance(url, str):
        raise bad_request(f"{where} must be a string (a data: URL, or a URL the server is allowed to fetch)",
                          param=where)
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad_request(f"{param}: detail={detail!r} is invalid; allowed: {', '.join(IMAGE_DETAILS)}",
                          param=f"{param}.detail")
    return ImagePart(url, f"{param}.image_url")


def load_images(parts: list[ImagePart], media: MediaConnector) -> list:
    """The PIL image of each part (blocking: decoding, reading a file, fetching a URL); a 400 naming the part."""
    images = []
    for part in parts:
        try:
            images.append(media.load_image(part.url))
        except ValueError as e:
            raise bad_request(f"{part.param}: {e}", param=part.param) from None
    return images
