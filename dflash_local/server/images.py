"""Images in requests: each API's image parts read into checked image bytes (or an http(s) URL, fetched by the engine
only under serve's --allow-remote-images), carried in a parsed message under IMAGES until InnerRequest takes them."""

from __future__ import annotations

import base64
import binascii
import urllib.request

from ..errors import DFlashError
from ..vision import MAX_IMAGE_BYTES, MEDIA_MARKER, check_image
from .protocol import IMAGES, BadRequest

__all__ = ["IMAGES", "MEDIA_MARKER", "Image", "attach", "decoded", "fetched", "of_url"]
REMOTE_TIMEOUT_S = 30
Image = bytes | str


def decoded(data: object, where: str) -> bytes:
    """Base64 image data, decoded and checked (vision.check_image), or a 400 naming where."""
    if not isinstance(data, str) or not data:
        raise BadRequest("An image's data must be a base64 string.", where)
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(f"The image is more than an image may be ({MAX_IMAGE_BYTES} bytes).", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("An image's data is not valid base64.", where) from None
    try:
        return check_image(raw, where)
    except DFlashError as exc:
        raise BadRequest(str(exc), where) from None


def of_url(url: object, where: str) -> Image:
    """An image URL: a data: URL's image, checked, or an http(s) URL as it is (fetched later, where allowed)."""
    if not isinstance(url, str):
        raise BadRequest("An image's URL must be a string.", where)
    if url.startswith("data:"):
        head, comma, data = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise BadRequest("An image's data: URL must be base64 (data:image/png;base64,...).", where)
        return decoded(data, where)
    if url.startswith(("http://", "https://")):
        return url
    raise BadRequest("An image's URL must be a data: URL or an http(s) URL.", where)


def attach(turn: dict, images: list[Image]) -> dict:
    """The parsed message with its images (its content holds one MEDIA_MARKER per image)."""
    if images:
        turn[IMAGES] = images
    return turn


def fetched(image: Image, allow_remote: bool) -> bytes:
    """An image's bytes: as parsed, or an http(s) URL fetched (at most MAX_IMAGE_BYTES) where serve allows it."""
    if isinstance(image, bytes):
        return image
    if not allow_remote:
        raise DFlashError("Image URLs are refused: send the image as base64 data (serve --allow-remote-images).")
    try:
        with urllib.request.urlopen(image, timeout=REMOTE_TIMEOUT_S) as response:  # noqa: S310 (http(s) only)
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise DFlashError(f"The image {image} could not be fetched ({exc}).") from None
    return check_image(data, f"The image {image}")
