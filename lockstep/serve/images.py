"""Image parts of chat requests: what the server accepts, checked before anything is decoded.

OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` parts in user messages, where ``url`` is

- a ``data:image/<type>;base64,<data>`` URL (PNG, JPEG, WebP or GIF, as OpenAI takes), or
- a ``file:///path`` URL, only when the server was started with ``--allowed-image-dir DIR`` and the
  path (symbolic links resolved) is a file inside ``DIR``; nothing else on the server's disk is read.

Web URLs are refused (this server downloads nothing), so are other schemes and bare paths. Before
an image is decoded, its header is read with Pillow limited to those formats (no other decoder
plugin runs on request data) and its size checked against :class:`ImageLimits` (``max_pixels``
per image, ``max_images`` per request: the decoder's memory is bounded). Then the messages go through
:func:`lockstep.generate.chat.message_images`, the loader ``lockstep generate --chat --image`` uses,
and each image is decoded here, in the request's handler thread, so a broken file is a 400 rather than
an error in the engine thread. Every refusal is an :class:`~lockstep.serve.protocol.ApiError` (400)
whose message starts with the part's field (``messages[1].content[0].image_url.url: ...``).

Whether the engine takes images at all is :func:`image_refusal`: the lockstep Engine over a
vision-language model does (``Engine.vision``); a text-only model or an engine without ``vision``
(``--engine vllm``: its wrapper hands vLLM text only) does not.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lockstep.config.base import ConfigError
from lockstep.generate.chat import message_images
from lockstep.generate.vision import has_vision
from lockstep.serve.protocol import ApiError

#: Pillow format names accepted (OpenAI's list); the header is read with these decoders only
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
#: default per-image limit: 4096 x 4096 (the model's processor then resizes to its own pixel bounds)
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES = 8


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What a request may send: images per request, pixels (width x height) per image, and the one
    directory ``file://`` URLs may name (None: no ``file://`` URLs)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS
    allowed_dir: Path | None = None

    def validate(self, prefix: str = "--") -> None:
        """ConfigError naming the flag (``prefix`` + the flag's name) of a bad limit."""
        if self.max_images < 1:
            raise ConfigError(f"{prefix}max-images-per-request: must be >= 1, got {self.max_images}")
        if self.max_pixels < 1:
            raise ConfigError(f"{prefix}max-image-pixels: must be >= 1, got {self.max_pixels}")
        if self.allowed_dir is not None and not Path(self.allowed_dir).is_dir():
            raise ConfigError(f"{prefix}allowed-image-dir {self.allowed_dir}: no such directory")


def image_refusal(engine: Any) -> str | None:
    """None when ``engine`` takes ``Request.images``; otherwise why not (the end of a 400's message)."""
    if getattr(engine, "vision", None) is not None:  # lockstep's Engine over a vision-language model
        return None
    model = getattr(engine, "model", None)
    config = getattr(model, "config", None)
    family = getattr(config, "family", type(model).__name__)
    if model is not None and has_vision(model):
        return (f"this server's {type(engine).__name__} takes text only, although the model ({family}) has a "
                f"vision tower; serve it with --engine lockstep for images")
    return f"the served model ({family}) takes text only (no vision tower)"


def _data_bytes(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    media = header[len("data:"):]
    if not comma or not media.endswith(";base64") or not media.startswith("image/"):
        raise ApiError(400, f"{where}: a data URL must be data:image/<type>;base64,<data>, got {header[:60]!r}",
                       where)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ApiError(400, f"{where}: the data URL's payload is not valid base64 ({err})", where) from None


def _allowed_file(url: str, where: str, allowed: Path | None) -> Path:
    if allowed is None:
        raise ApiError(400, f"{where}: file:// URLs are refused: the server was started without "
                            f"--allowed-image-dir (send the image as a data:image/...;base64 URL)", where)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ApiError(400, f"{where}: a file:// URL names a local file (file:///path), got host {parsed.netloc!r}",
                       where)
    root = Path(allowed).resolve()
    try:
        path = Path(urllib.parse.unquote(parsed.path)).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a symlink loop, a NUL byte
        path = None
    if path is None or not path.is_relative_to(root) or not path.is_file():
        raise ApiError(400, f"{where}: no image file {parsed.path!r} inside the allowed image directory", where)
    return path


def _check_header(source: Any, where: str, limits: ImageLimits) -> None:
    """Read only the header (decoders of :data:`FORMATS`): a refused format or too many pixels is a 400."""
    from PIL import Image

    try:
        with Image.open(source, formats=list(FORMATS)) as image:
            width, height = image.size
    except Image.DecompressionBombError as err:
        raise ApiError(400, f"{where}: {err}", where) from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ApiError(400, f"{where}: not an image in a supported format ({', '.join(FORMATS)}): {err}",
                       where) from None
    if width * height > limits.max_pixels:
        raise ApiError(400, f"{where}: the image is {width}x{height} = {width * height} pixels; this server takes "
                            f"at most {limits.max_pixels} per image (--max-image-pixels)", where)


def checked_reference(url: str, where: str, limits: ImageLimits) -> str:
    """The reference :func:`message_images` loads for ``url`` (checked: scheme, directory, base64,
    format, size); an :class:`ApiError` naming ``where`` otherwise."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ApiError(400, f"{where}: {url[:80]!r} is a web URL; this server does no network fetches (send the "
                            f"image as a data:image/...;base64 URL)", where)
    if scheme == "data":
        _check_header(io.BytesIO(_data_bytes(url, where)), where, limits)
        return url
    if scheme == "file":
        path = _allowed_file(url, where, limits.allowed_dir)
        _check_header(path, where, limits)
        return str(path)
    raise ApiError(400, f"{where}: an image URL must be a data:image/...;base64 URL (or file:// with "
                        f"--allowed-image-dir), got {url[:80]!r}", where)


def load_images(messages: Sequence[Mapping[str, Any]], limits: ImageLimits) -> list[Any]:
    """The decoded PIL images of ``messages``' ``image_url`` parts, in order (``Request.images``)."""
    where_of: list[str] = []
    checked = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            checked.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if part["type"] == "image_url":
                where = f"messages[{i}].content[{j}].image_url.url"
                if len(where_of) == limits.max_images:
                    raise ApiError(400, f"messages: more than {limits.max_images} images in one request; this "
                                        f"server takes at most {limits.max_images} (--max-images-per-request)",
                                   "messages")
                where_of.append(where)
                part = {"type": "image_url", "image_url": {"url": checked_reference(part["image_url"]["url"],
                                                                                    where, limits)}}
            parts.append(part)
        checked.append({**message, "content": parts})
    try:
        images = message_images(checked)
    except ConfigError as err:  # the message starts with messages[i].content[j]
        for where in where_of:  # an image part's decoding failed (message_images decodes each image whole)
            part = where.removesuffix(".image_url.url") + ": "
            if str(err).startswith(part):
                reason = str(err)[len(part):].split(": ", 1)[-1]
                raise ApiError(400, f"{where}: the image cannot be decoded: {reason}", where) from None
        raise ApiError(400, str(err), "messages") from None
    for image, where in zip(images, where_of, strict=True):
        if image.format not in FORMATS:  # message_images opened it with every decoder: the same one?
            raise ApiError(400, f"{where}: not an image in a supported format ({', '.join(FORMATS)})", where)
    return images
