"""Image files the flow trainer writes: grids of samples, written atomically."""

from __future__ import annotations

import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from grouprl.files import AtomicFile


def grid(images: list[Image.Image], *, columns: int | None = None, captions: list[str] | None = None,
         row_labels: list[str] | None = None, scale: int = 1) -> Image.Image:
    """The images tiled row by row (``columns`` default: about square), each upscaled by ``scale``
    (nearest neighbour, so tiny samples stay legible). ``captions`` (one per image) are wrapped to
    the image's width under it, ``"\n"`` forcing a break; ``row_labels`` (one per row) go in a
    margin on the left. Nothing is cut: the strips grow to the longest caption and label."""
    if not images:
        raise ValueError("grid: no images")
    columns = columns or max(1, round(len(images) ** 0.5))
    rows = -(-len(images) // columns)
    if captions is not None and len(captions) != len(images):
        raise ValueError(f"grid: {len(captions)} captions for {len(images)} images")
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(f"grid: {len(row_labels)} row labels for {rows} rows")
    font = ImageFont.load_default()
    char_w, line_h = _text_size(font, "M")
    line_h += 2
    w, h = images[0].width * scale, images[0].height * scale
    wrapped = [_wrap(c, max(1, (w - 2) // char_w)) for c in captions] if captions else None
    strip = max(len(lines) for lines in wrapped) * line_h + 2 if wrapped else 0
    labels = [_wrap(label, 16) for label in row_labels] if row_labels else None
    margin = max(_text_size(font, line)[0] for lines in labels for line in lines) + 8 if labels else 0
    canvas = Image.new("RGB", (margin + columns * w, rows * (h + strip)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, image in enumerate(images):
        x, y = margin + (i % columns) * w, (i // columns) * (h + strip)
        canvas.paste(image.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        for j, line in enumerate(wrapped[i] if wrapped else []):
            draw.text((x + 1, y + h + 1 + j * line_h), line, fill="black", font=font)
    for r, lines in enumerate(labels or []):
        top = r * (h + strip) + (h - len(lines) * line_h) // 2
        for j, line in enumerate(lines):
            draw.text((4, top + j * line_h), line, fill="black", font=font)
    return canvas


def _text_size(font, text: str) -> tuple[int, int]:
    left, top, right, bottom = font.getbbox(text)
    return right - left, bottom - top


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters (words kept whole where they fit)."""
    return [line for part in text.split("\n") for line in (textwrap.wrap(part, width) or [""])]


def save_grid(images: list[Image.Image], path: str | Path, *, columns: int | None = None,
              captions: list[str] | None = None, row_labels: list[str] | None = None,
              scale: int | None = None) -> Path:
    """``grid(...)`` saved as PNG at ``path``, atomically (a crash leaves the old file or none)."""
    path = Path(path)
    if scale is None:  # small samples are blown up to about 128 px
        scale = max(1, 128 // max(images[0].width, 1)) if images else 1
    image = grid(images, columns=columns, captions=captions, row_labels=row_labels, scale=scale)
    with AtomicFile(path, "wb") as fh:
        image.save(fh, format="PNG")
    return path
