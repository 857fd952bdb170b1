"""Images in chat messages: OpenAI `image_url` parts read into bytes, checked against the server's
limits before anything expensive runs, and left in the messages as `{"type": "image"}` parts that
the chat template renders as the model's image placeholder.

Sources: `data:` URIs (base64), and local files only under `--allowed-local-media-path` (a
`file://` URL or a plain path, resolved, symlinks included, and refused outside that directory).
Nothing is fetched over the network: an http(s) URL is a 400 that says so. Limits, each a 400:
images per request (`--limit-mm-per-prompt`), encoded bytes per image, and pixels per image (read
from the header, before the image is decoded).
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path

from .protocol import ServeError


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = 8                    # per request
    max_bytes: int = 16 << 20              # per encoded image
    max_pixels: int = 40_000_000           # per image, width x height
    allowed_local_path: str | None = None  # local files only under here


def _url(part: dict, where: str) -> str:
    v = part.get("image_url")
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise ServeError(400, f"{where}: an image_url part needs image_url.url (a data: URI or an allowed local file)")
    return url


def _from_data_uri(url: str, limits: MediaLimits, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ServeError(400, f"{where}: a data URI must be base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ServeError(400, f"{where}: the image is over {limits.max_bytes} bytes")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ServeError(400, f"{where}: the data URI's base64 is not valid") from None
    if len(raw) > limits.max_bytes:
        raise ServeError(400, f"{where}: the image is {len(raw)} bytes, over the limit of {limits.max_bytes}")
    return raw


def _from_file(url: str, limits: MediaLimits, where: str) -> bytes:
    if limits.allowed_local_path is None:
        raise ServeError(400, f"{where}: local image files are off; start the server with --allowed-local-media-path DIR")
    path = Path(url[len("file://"):] if url.startswith("file://") else url).resolve()
    root = Path(limits.allowed_local_path).resolve()
    if root != path and root not in path.parents:
        raise ServeError(400, f"{where}: {url} is outside --allowed-local-media-path")
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise ServeError(400, f"{where}: the image is {size} bytes, over the limit of {limits.max_bytes}")
        return path.read_bytes()
    except OSError as e:
        raise ServeError(400, f"{where}: cannot read {url}: {e.strerror or e}") from None


def read_image(url: str, limits: MediaLimits, where: str) -> bytes:
    if url.startswith("data:"):
        return _from_data_uri(url, limits, where)
    if url.split(":", 1)[0].lower() in ("http", "https", "ftp"):
        raise ServeError(400, f"{where}: this server does not fetch images over the network; send a data: URI")
    return _from_file(url, limits, where)


def image_size(raw: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the header alone: a huge image is refused before it is decoded."""
    import io

    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(raw)) as im:
            return im.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ServeError(400, f"{where}: not a readable image ({e})") from None


IMAGE_PARTS = ("image_url", "input_image", "image")


VIDEO_PARTS = ("video_url", "video", "input_video")


def check_parts(messages: list[dict]) -> None:
    """A content part ouro cannot read (audio, files, an unknown type) is a 400 naming it: refused,
    never dropped from the prompt unseen. Text and images are read."""
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, p in enumerate(content if isinstance(content, list) else ()):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in VIDEO_PARTS:
                raise ServeError(400, f"messages[{i}].content[{j}]: video input is not supported; send frames as images")
            if kind not in ("text", *IMAGE_PARTS):
                raise ServeError(400, f"messages[{i}].content[{j}]: content parts of type {kind!r} are not supported; "
                                      f"ouro reads 'text' and image parts ({', '.join(IMAGE_PARTS)})")


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def collect_images(messages: list[dict], limits: MediaLimits) -> tuple[list[dict], list[bytes]]:
    """(messages with each image part as {"type": "image"}, the images' bytes in prompt order)."""
    images, out = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in IMAGE_PARTS:
                where = f"messages[{i}].content[{j}]"
                if len(images) >= limits.max_images:
                    raise ServeError(400, f"{where}: more than {limits.max_images} images in one request "
                                        "(--limit-mm-per-prompt)")
                raw = read_image(_url(p, where) if kind != "image" else p.get("image", ""), limits, where)
                w, h = image_size(raw, where)
                if w * h > limits.max_pixels:
                    raise ServeError(400, f"{where}: the image is {w}x{h} = {w * h} pixels, over the limit of "
                                        f"{limits.max_pixels}")
                images.append(raw)
                parts.append({"type": "image"})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out, images
