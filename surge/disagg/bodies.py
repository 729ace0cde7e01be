"""Request and response bodies as the proxy sees them: only the top-level keys are split apart, each value kept as
its raw JSON bytes; the few the proxy routes on are decoded, and a changed body is the same bytes with some values
swapped (a join of slices, nothing re-encoded). Response bytes are relayed untouched.

`ParsedBodies` in surge/bench/proxy.py is the baseline this replaces: json.loads / json.dumps of every body and
every streamed event.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_bool = msgspec.json.Decoder(bool)
_int = msgspec.json.Decoder(int)
_key = msgspec.json.encode

# Per API, the keys that bound the number of tokens generated: the prefill leg sets them to 1.
LIMIT_KEYS = {"completions": ("max_tokens",), "chat": ("max_tokens", "max_completion_tokens"),
              "responses": ("max_output_tokens",)}


class PrefillAnswer(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")  # (msgspec takes no Raw in a union)


_answer = msgspec.json.Decoder(PrefillAnswer)


@dataclass
class Route:
    """What the proxy decided from a request body: whether the client wants a stream, and whether the request can
    be split into a prefill and a decode leg (one prompt, one sample)."""
    stream: bool
    split: bool
    body: object  # the codec's own view of the body
    images: bool = False  # it carries image parts: an encoder instance, if any, encodes them first


def _raw(value) -> bytes:
    return value if isinstance(value, bytes) else bytes(value)  # a Raw's bytes


class RawBodies:
    """The byte-passthrough codec."""

    def parse(self, body: bytes, api: str) -> Route:
        fields = _fields.decode(body)  # ValueError (msgspec.DecodeError) on anything but a JSON object
        stream = _bool.decode(fields["stream"]) if "stream" in fields else False
        n = _int.decode(fields["n"]) if "n" in fields else 1
        return Route(stream, n == 1 and not _several_prompts(fields.get("prompt")), fields,
                     _has_images(fields.get(_CONTENT_KEYS.get(api, ""))))

    @staticmethod
    def _join(fields: dict[str, msgspec.Raw], changes: dict[str, bytes | None]) -> bytes:
        """The object with `changes` applied (None: the key removed); untouched values are the client's bytes."""
        pieces: list = []
        for items in ([(k, v) for k, v in fields.items() if k not in changes],
                      [(k, v) for k, v in changes.items() if v is not None]):
            for k, v in items:
                pieces += (b",", _key(k), b":", v)  # a Raw is a buffer: joined without a copy of its own
        if not pieces:
            return b"{}"
        pieces[0] = b"{"
        return b"".join(pieces) + b"}"

    def prefill_body(self, route: Route, api: str, transfer_id: str) -> bytes:
        changes: dict[str, bytes | None] = {k: b"1" for k in LIMIT_KEYS[api]}
        changes.update(stream=b"false", stream_options=None, min_tokens=b"0",
                       kv_transfer_params=b'{"do_remote_decode":true,"transfer_id":' + _key(transfer_id) + b"}")
        return self._join(route.body, changes)

    def transfer_params(self, answer: bytes) -> bytes | None:
        raw = _raw(_answer.decode(answer).kv_transfer_params)
        return None if raw == b"null" else raw

    def encode_body(self, route: Route) -> bytes:
        """The encoder instance's leg: the client's body, answered whole (no stream)."""
        return self._join(route.body, {"stream": b"false", "stream_options": None})

    def decode_body(self, route: Route, params: bytes) -> bytes:
        return self._join(route.body, {"kv_transfer_params": params})

    def relay(self, chunk: bytes) -> bytes:
        return chunk


# Per API, the key whose value holds content parts, and the part types that carry an image.
_CONTENT_KEYS = {"chat": "messages", "responses": "input"}
_IMAGE_TYPES = (b'"image_url"', b'"input_image"')


def _has_images(raw) -> bool:
    """Whether the messages (or input) hold an image part, by a scan of their bytes for the part types' quoted
    names, without decoding them. Inside a JSON string a quote is escaped, so text that mentions a type is no match;
    a text part that is exactly the word only sends a request through the encoder instance for nothing."""
    if raw is None:
        return False
    data = _raw(raw)
    return any(t in data for t in _IMAGE_TYPES)


def _several_prompts(raw) -> bool:
    """A completions prompt that is a list of prompts (strings or token lists), not one prompt of token ids."""
    if raw is None:
        return False
    head = _raw(raw).lstrip()
    return head[:1] == b"[" and head[1:].lstrip()[:1] in (b'"', b"[")
