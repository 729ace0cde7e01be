"""Images as clients send them: `data:` URLs (base64) always; local files and http(s) URLs only where the operator
allows them (--allowed-local-media-path, --allowed-media-domains; both off by default). Every fetch is bounded in
bytes, seconds and decoded pixels, and every refusal is a ValueError that names the rule (the flag) it broke."""
from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decompression bomb's guard: 8192 x 8192
MAX_MEDIA_BYTES = 32 << 20  # the most bytes one image may have, read from a file or fetched
# The most seconds one http(s) fetch's body may take (checked as it arrives); connecting, and each read of the
# headers, are bounded by it too.
MEDIA_FETCH_TIMEOUT_S = 10.0

_DOMAINS_FLAG = "--allowed-media-domains"
_LOCAL_FLAG = "--allowed-local-media-path"


@dataclass(frozen=True)
class MediaConnector:
    """Where images may come from, and how large they may be."""
    allowed_local_media_path: str | None = None  # a directory: file:// URLs and absolute paths under it
    allowed_media_domains: tuple[str, ...] = ()  # host names http(s) URLs may name
    max_bytes: int = MAX_MEDIA_BYTES
    timeout_s: float = MEDIA_FETCH_TIMEOUT_S
    max_pixels: int = MAX_IMAGE_PIXELS

    def load_image(self, url: str):
        """A PIL image (decoded, not converted) from a data:, file:// or http(s) URL or an absolute path."""
        if not isinstance(url, str):
            raise ValueError(f"an image URL must be a string, got {type(url).__name__}")
        if url.startswith("data:"):
            return image_from_bytes(_data_url_bytes(url), self.max_pixels)
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return image_from_bytes(self._fetch(url), self.max_pixels)
        if scheme == "file" or url.startswith("/"):
            return image_from_bytes(self._read_local(url), self.max_pixels)
        raise ValueError(f"unsupported image URL scheme {scheme!r}: images are data: URLs (base64), http(s) URLs "
                         f"from {_DOMAINS_FLAG}, or files under {_LOCAL_FLAG}")

    def _read_local(self, url: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError(f"local image files are off: the server reads them only under {_LOCAL_FLAG} DIR")
        parts = urlsplit(url)
        if parts.scheme and parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// URL names no host (got {parts.netloc!r})")
        root = Path(self.allowed_local_media_path).resolve()
        # Resolved (symlinks followed, '..' removed) before the check, so no link or '..' leads out of the root.
        path = Path(unquote(parts.path) if parts.scheme else url).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"the image path is outside {_LOCAL_FLAG} ({root})")
        try:
            with path.open("rb") as f:
                raw = f.read(self.max_bytes + 1)
        except OSError as e:
            raise ValueError(f"cannot read the image file under {_LOCAL_FLAG}: {e.strerror}") from None
        self._bounded_size(len(raw))
        return raw

    def _fetch(self, url: str) -> bytes:
        import httpx
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.allowed_media_domains:
            rule = (f"allowed: {', '.join(self.allowed_media_domains)}" if self.allowed_media_domains
                    else "remote images are off")
            raise ValueError(f"the image URL's host {host!r} is not in {_DOMAINS_FLAG} ({rule})")
        deadline = time.monotonic() + self.timeout_s
        try:
            # No redirects: one could lead to a host the operator did not allow.
            with httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=False) as r:
                if r.status_code != 200:
                    raise ValueError(f"fetching the image URL answered HTTP {r.status_code} (redirects are not "
                                     "followed)")
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    chunks.append(chunk)
                    self._bounded_size(size)
                    if time.monotonic() > deadline:
                        raise ValueError(f"fetching the image URL took over {self.timeout_s:g} s")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot fetch the image URL ({type(e).__name__}: {e})") from None
        return b"".join(chunks)

    def _bounded_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise ValueError(f"the image has more than {self.max_bytes} bytes, the most one image may have")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data URL must be base64: data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data URL's payload is not valid base64") from None


def image_from_bytes(raw: bytes, max_pixels: int = MAX_IMAGE_PIXELS):
    """Decoded, after the header's size passed the pixel limit (so a decompression bomb is never inflated)."""
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(raw))
        too_large = image.width * image.height > max_pixels
        if not too_large:
            image.load()
    except Exception as e:  # PIL raises many types on hostile bytes (OSError, SyntaxError, struct.error, ...)
        raise ValueError(f"cannot decode the image ({type(e).__name__}: {e})") from None
    if too_large:
        raise ValueError(f"the image is {image.width}x{image.height}, over the limit of {max_pixels} pixels")
    return image
