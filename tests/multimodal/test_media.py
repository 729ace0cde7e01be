"""Where images may come from (surge/multimodal/media.py): data: URLs always; local files only under
--allowed-local-media-path (resolved, so neither '..' nor a symlink leads out); http(s) only from
--allowed-media-domains, bounded in bytes, seconds and pixels. Every refusal is a ValueError naming its rule."""
from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from media_server import MediaServer
from surge.multimodal.media import MAX_IMAGE_PIXELS, MediaConnector, image_from_bytes


def png(width: int = 12, height: int = 8, mode: str = "RGB") -> bytes:
    if mode == "RGB":
        image = Image.fromarray(np.random.RandomState(width).randint(0, 255, (height, width, 3), dtype=np.uint8))
    else:
        image = Image.new(mode, (width, height))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_data_url_decodes_and_bad_ones_name_the_problem():
    raw = png()
    image = MediaConnector().load_image("data:image/png;base64," + base64.b64encode(raw).decode())
    assert (pixels(image) == pixels(Image.open(io.BytesIO(raw)))).all()
    for url, message in [("data:image/png;base64,@@@", "not valid base64"),
                         ("data:image/png," + "abc", "must be base64"),
                         ("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
                          "cannot decode the image"),
                         ("data:image/png;base64," + base64.b64encode(raw[:40]).decode(), "cannot decode the image"),
                         ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
                         ("relative/a.png", "unsupported image URL scheme ''")]:
        with pytest.raises(ValueError, match=message):
            MediaConnector().load_image(url)


def test_a_decompression_bomb_is_refused_before_it_is_inflated():
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 8  # a bilevel PNG: a few kB that would inflate to 200 MB as RGB
    raw = png(side, side, mode="1")
    assert len(raw) < 1 << 20
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"{side}x{side}, over the limit of {MAX_IMAGE_PIXELS} pixels"):
        image_from_bytes(raw)
    assert time.monotonic() - start < 1.0  # the header only: decoding 67 M pixels would take longer
    with pytest.raises(ValueError, match="12x8, over the limit of 95 pixels"):
        image_from_bytes(png(), max_pixels=95)


def test_local_files_only_under_the_allowed_directory(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "a b.png").write_bytes(png())
    (outside / "b.png").write_bytes(png(9, 9))
    (root / "link.png").symlink_to(outside / "b.png")
    (root / "dir-link").symlink_to(outside)
    media = MediaConnector(allowed_local_media_path=str(root))
    expected = pixels(Image.open(root / "a b.png"))
    for url in [f"file://{root}/a%20b.png", str(root / "a b.png"), f"file://localhost{root}/a%20b.png",
                f"{root}/../media/a b.png"]:
        assert (pixels(media.load_image(url)) == expected).all(), url
    for url in [str(outside / "b.png"), f"file://{root}/../secret/b.png", str(root / "link.png"),
                f"file://{root}/dir-link/b.png", "/etc/passwd"]:
        with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
            media.load_image(url)
    with pytest.raises(ValueError, match="cannot read the image file"):
        media.load_image(str(root / "missing.png"))
    with pytest.raises(ValueError, match="names no host"):
        media.load_image(f"file://example.com{root}/a%20b.png")
    with pytest.raises(ValueError, match="more than 100 bytes"):
        MediaConnector(allowed_local_media_path=str(root), max_bytes=100).load_image(str(root / "a b.png"))
    with pytest.raises(ValueError, match="local image files are off: .* --allowed-local-media-path"):
        MediaConnector().load_image(str(root / "a b.png"))


def test_remote_images_only_from_allowed_hosts_and_bounded():
    raw = png()
    with MediaServer({"a.png": raw, "big.png": png(300, 300), "text": b"hello"}) as server:
        media = MediaConnector(allowed_media_domains=("127.0.0.1",), max_bytes=64 << 10, timeout_s=1.0)
        assert (pixels(media.load_image(server.url + "/a.png")) == pixels(Image.open(io.BytesIO(raw)))).all()
        for url, message in [
            (server.url.replace("127.0.0.1", "localhost") + "/a.png",
             r"host 'localhost' is not in --allowed-media-domains \(allowed: 127.0.0.1\)"),
            (server.url + "/missing.png", "answered HTTP 404"),
            (server.url + "/redirect", "answered HTTP 302 .redirects are not followed"),
            (server.url + "/text", "cannot decode the image"),
            (server.url + "/big.png", f"more than {64 << 10} bytes"),
            (server.url + "/slow", "took over 1 s"),
        ]:
            start = time.monotonic()
            with pytest.raises(ValueError, match=message):
                media.load_image(url)
            assert time.monotonic() - start < 5.0, url  # every fetch bounded, the trickle included
        with pytest.raises(ValueError, match="--allowed-media-domains .remote images are off"):
            MediaConnector().load_image(server.url + "/a.png")
