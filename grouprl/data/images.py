"""Images of dataset records: what a record may hold, checking it, opening it, resizing it.

A record's image arrives as a file path, raw bytes, a ``{"bytes", "path"}`` dict
(how Hugging Face datasets and parquet files store their image feature) or a PIL
image. ``resolve_image`` turns any of these into an ``ImageRef``: an absolute path,
bytes, or a PIL image. References stay small so that a dataset can check every
image when it is loaded and decode them only when a sample is read.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Union

from PIL import Image

ImageRef = Union[str, bytes, Image.Image]


class ImageError(ValueError):
    """An image value that cannot be used; the caller adds which record and field."""


def resolve_image(value: Any, base_dir: str | os.PathLike) -> ImageRef:
    """Turn a record's image value into a path, bytes or a PIL image.

    A relative path is taken relative to ``base_dir``. Nothing is opened here;
    ``check_image`` does that.
    """
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) == 0:
            raise ImageError("image bytes are empty")
        return bytes(value)
    if isinstance(value, dict):
        # The Hugging Face Image feature: embedded bytes win over the path, which
        # is often just the name the file had on the machine that built the set.
        if value.get("bytes") is not None:
            return resolve_image(value["bytes"], base_dir)
        if value.get("path") is not None:
            return resolve_image(value["path"], base_dir)
        raise ImageError(f"image dict has neither 'bytes' nor 'path': keys {sorted(value)}")
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if not text:
            raise ImageError("image path is empty")
        if text.startswith(("http://", "https://")):
            raise ImageError(f"image URLs are not fetched; download the image and give its path: {text}")
        path = os.path.expanduser(text)
        if not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        return os.path.abspath(path)
    raise ImageError(
        f"expected an image path, bytes, a {{'bytes', 'path'}} dict or a PIL image, got {type(value).__name__}"
    )


def check_image(ref: ImageRef) -> None:
    """Fail now, not in the middle of training, if the image is missing or cannot be decoded."""
    if isinstance(ref, Image.Image):
        return
    if isinstance(ref, str) and not os.path.isfile(ref):
        raise ImageError(f"image file not found: {ref}")
    source = ref if isinstance(ref, str) else io.BytesIO(ref)
    try:
        with Image.open(source) as image:
            image.verify()
    except Exception as exc:  # PIL raises many types for corrupt data
        where = ref if isinstance(ref, str) else f"{len(ref)} bytes"
        raise ImageError(f"cannot decode image ({where}): {exc}") from exc


def open_image(ref: ImageRef, *, min_pixels: int | None = None, max_pixels: int | None = None) -> Image.Image:
    """Decode an image to RGB, resized into the pixel range; never modifies a PIL input."""
    if isinstance(ref, Image.Image):
        image = ref
    else:
        source = ref if isinstance(ref, str) else io.BytesIO(ref)
        try:
            image = Image.open(source)
            image.load()
        except FileNotFoundError as exc:
            raise ImageError(f"image file not found: {ref}") from exc
        except Exception as exc:
            where = ref if isinstance(ref, str) else f"{len(ref)} bytes"
            raise ImageError(f"cannot decode image ({where}): {exc}") from exc
    # convert() returns a new image even when the mode is already RGB, so the
    # caller's PIL image is never shared with (or changed by) the sample.
    image = image.convert("RGB")
    return resize_to_pixel_range(image, min_pixels=min_pixels, max_pixels=max_pixels)


def check_pixel_range(min_pixels: int | None, max_pixels: int | None) -> None:
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels})")


def resize_to_pixel_range(
    image: Image.Image, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> Image.Image:
    """Scale ``image`` keeping its aspect ratio so that width * height lies in [min_pixels, max_pixels].

    This is the resize EasyR1 applies (``data.min_pixels`` / ``data.max_pixels``)
    before the processor sees the image: it bounds the number of vision tokens.
    Rounding is down when shrinking and up when growing, so the bound holds
    (unless a tight range and integer sides make both bounds impossible at once;
    then the minimum wins). An image already in range is returned unchanged.
    """
    check_pixel_range(min_pixels, max_pixels)
    width, height = image.size
    area = width * height
    if max_pixels is not None and area > max_pixels:
        scale = math.sqrt(max_pixels / area)
        new_w, new_h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
        # A very thin image can round a side up to 1 pixel; trim the other side
        # so that the bound still holds.
        new_w = min(new_w, max(1, max_pixels // new_h))
        new_h = min(new_h, max_pixels // new_w)
        return image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    if min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        new_w, new_h = math.ceil(width * scale), math.ceil(height * scale)
        # Rounding both sides up can overshoot a tight max_pixels; give back a
        # pixel on the longer side while the minimum still holds.
        while max_pixels is not None and new_w * new_h > max_pixels:
            if new_w >= new_h and (new_w - 1) * new_h >= min_pixels:
                new_w -= 1
            elif (new_h - 1) * new_w >= min_pixels:
                new_h -= 1
            else:
                break
        return image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    return image
