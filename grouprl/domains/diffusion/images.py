"""Image files the flow trainer writes: grids of samples, written atomically."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from grouprl.files import AtomicFile


def grid(images: list[Image.Image], *, columns: int | None = None, captions: list[str] | None = None,
         scale: int = 1, caption_height: int = 12) -> Image.Image:
    """The images tiled row by row (``columns`` default: about square), each upscaled by ``scale``
    (nearest neighbour, so tiny samples stay legible) with an optional caption strip under it."""
    if not images:
        raise ValueError("grid: no images")
    columns = columns or max(1, round(len(images) ** 0.5))
    rows = -(-len(images) // columns)
    w, h = images[0].width * scale, images[0].height * scale
    strip = caption_height if captions else 0
    canvas = Image.new("RGB", (columns * w, rows * (h + strip)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, image in enumerate(images):
        x, y = (i % columns) * w, (i // columns) * (h + strip)
        canvas.paste(image.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        if captions:
            draw.text((x + 1, y + h), captions[i][: max(1, w // 6)], fill="black")
    return canvas


def save_grid(images: list[Image.Image], path: str | Path, *, columns: int | None = None,
              captions: list[str] | None = None, scale: int | None = None) -> Path:
    """``grid(...)`` saved as PNG at ``path``, atomically (a crash leaves the old file or none)."""
    path = Path(path)
    if scale is None:  # small samples are blown up to about 128 px
        scale = max(1, 128 // max(images[0].width, 1)) if images else 1
    image = grid(images, columns=columns, captions=captions, scale=scale)
    with AtomicFile(path, "wb") as fh:
        image.save(fh, format="PNG")
    return path
