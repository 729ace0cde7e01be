"""Images as clients send them: decoded from `data:` URLs (base64) into PIL images, with errors that say what was
wrong. Remote URLs and local paths are refused unless the operator allows them (not implemented yet)."""
from __future__ import annotations

import base64
import binascii
import io

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decompression bomb's guard: 8192 x 8192


def image_from_url(url: str):
    """A PIL image from a `data:image/...;base64,` URL; a ValueError naming the rule for anything else."""
    if not isinstance(url, str):
        raise ValueError(f"an image URL must be a string, got {type(url).__name__}")
    if not url.startswith("data:"):
        raise ValueError("only data: URLs (data:image/...;base64,...) are accepted for images; fetching remote URLs "
                         "and local paths is off (--allowed-media-domains / --allowed-local-media-path are not "
                         "supported yet)")
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data URL must be base64: data:image/<type>;base64,<data>")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data URL's payload is not valid base64") from None
    return image_from_bytes(raw)


def image_from_bytes(raw: bytes):
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image is {image.width}x{image.height}, over the limit of {MAX_IMAGE_PIXELS} "
                             "pixels")
        image.load()
    except (OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"cannot decode the image ({type(e).__name__}: {e})") from None
    return image
