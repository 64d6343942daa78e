"""Sample grids: captions wrapped (never cut) under each image, a label for each row."""

import pytest
from PIL import Image, ImageFont

from grouprl.domains.diffusion.images import grid


def ink(canvas, box) -> bool:
    """Whether anything but white was drawn inside ``box`` (left, top, right, bottom)."""
    return canvas.crop(box).convert("L").getextrema()[0] < 250


def squares(n, size=8):
    return [Image.new("RGB", (size, size), (40 * i, 90, 200)) for i in range(n)]


def test_rows_are_labelled_and_captions_wrap_to_the_image_width():
    prompt = "two green squares on the right of the image"
    canvas = grid(squares(4), columns=2, scale=4, captions=[f"{prompt}\nreward 0.{i}" for i in range(4)],
                  row_labels=["pretrained", "pretrained + Flow-GRPO-Fast"])
    left, top, right, bottom = ImageFont.load_default().getbbox("M")
    line_h = bottom - top + 2
    w = h = 32  # 8 px images at scale 4
    margin = canvas.width - 2 * w
    assert margin > 0
    strip = canvas.height // 2 - h
    # 32 px hold 4 characters a line: the prompt takes many lines, then the score on a line of its own
    assert strip >= 6 * line_h
    for row in range(2):
        y = row * (h + strip)
        assert ink(canvas, (0, y, margin - 1, y + h))  # the row's label
        for col in range(2):
            x = margin + col * w
            assert ink(canvas, (x, y + h, x + w, y + h + line_h))  # first caption line
            assert ink(canvas, (x, y + h + strip - line_h - 2, x + w, y + h + strip))  # the last one, not cut


def test_without_labels_the_grid_is_just_the_images():
    canvas = grid(squares(6), columns=3, scale=2)
    assert canvas.size == (3 * 16, 2 * 16)


@pytest.mark.parametrize("kwargs, message", [
    ({"captions": ["a", "b"]}, "2 captions for 4 images"),
    ({"row_labels": ["only one"]}, "1 row labels for 2 rows"),
])
def test_a_label_or_caption_per_row_or_image_or_an_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grid(squares(4), columns=2, **kwargs)
