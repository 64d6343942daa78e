"""The radiology domain's tools: ``zoom``, an enlarged view of one region of the chest film.

:class:`ZoomEnvironment` is one per dialogue: ``reset(sample)`` keeps the sample's film (its
first image) and the policy calls ``zoom(region)``, which returns the region cropped from the
film and enlarged to the film's size, as an image the vision-language policy reads in its next
turn, with a line of text saying what it shows.

The regions are those of the synthetic studies' grounding tasks
(:data:`~grouprl.domains.radiology.synthetic.cxr.REGIONS`), placed by the studies' own geometry
(:func:`~grouprl.domains.radiology.synthetic.cxr.region_boxes` on the middle of every random
range of :func:`~grouprl.domains.radiology.synthetic.cxr.sample_layout`, the heart at its largest),
widened by :data:`JITTER` so that one box holds the region on every film whatever its random
shift and sizes, then grown to the film's aspect ratio so that the enlargement does not stretch
it. A film is a flat image: the boxes are fractions of its width and height, whatever its size.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Literal

import numpy as np
from PIL import Image

from grouprl.domains.radiology.synthetic.cxr import REGIONS, BoxCoords, region_boxes, sample_layout
from grouprl.rollout.environments import Environment

# How far (in fractions of the film) a region's edge moves between films: the film's random shift
# (0.02), its lung / heart centres (0.015) and half-sizes (0.015), with room to spare.
JITTER = 0.05


def zoom_box(region: str, aspect: float = 1.0) -> BoxCoords:
    """The box ``(x1, y1, x2, y2)``, fractions of the film, that ``zoom`` crops for ``region``.

    ``region``'s box on the middle synthetic film (:func:`_nominal_boxes`) widened by
    :data:`JITTER` on every side and clipped to the film, then its shorter side grown about its
    centre until ``width / height == aspect`` (the film's width / height, in pixels; unless that
    side would outgrow the film) and shifted back inside the film. A ValueError names an unknown region and the valid ones.
    """
    boxes = _nominal_boxes()
    if region not in boxes:
        raise ValueError(f"unknown region {region!r}; zoom takes one of: {', '.join(REGIONS)}")
    x1, y1, x2, y2 = boxes[region]
    x1, y1 = max(x1 - JITTER, 0.0), max(y1 - JITTER, 0.0)
    x2, y2 = min(x2 + JITTER, 1.0), min(y2 + JITTER, 1.0)
    # sides in pixels of a film of width `aspect` and height 1
    width, height = (x2 - x1) * aspect, y2 - y1
    if width < height:
        x1, x2 = _grow(x1, x2, height / aspect)
    else:
        y1, y2 = _grow(y1, y2, width)
    return (x1, y1, x2, y2)


def _grow(start: float, end: float, size: float) -> tuple[float, float]:
    """``[start, end]`` grown about its centre to ``size`` (at most 1), then moved inside [0, 1]."""
    size = min(size, 1.0)
    centre = (start + end) / 2
    start = min(max(centre - size / 2, 0.0), 1.0 - size)
    return start, start + size


@lru_cache(maxsize=1)
def _nominal_boxes() -> dict[str, BoxCoords]:
    """:func:`region_boxes` of the middle film: every random range of ``sample_layout`` at its middle,
    no shift, the heart at its largest (cardiomegaly's top grade), so the box holds an enlarged heart."""
    layout = sample_layout(np.random.default_rng(0))
    layout = dataclasses.replace(
        layout, shift=(0.0, 0.0),
        lungs={"right": (0.30, 0.46, 0.165, 0.31), "left": (0.70, 0.47, 0.155, 0.30)},
        dome={"right": 0.66, "left": 0.69}, heart=(0.535, 0.66, 0.125, 0.125), cardiomegaly_grade=2)
    return region_boxes({"cardiomegaly": 1}, layout)


class ZoomEnvironment(Environment):
    """One dialogue's chest film, and the ``zoom`` tool over it."""

    def __init__(self) -> None:
        self.film: Image.Image | None = None

    def reset(self, sample) -> None:
        """Keep ``sample``'s first image (the chest film) for this dialogue."""
        if not sample.images:
            raise ValueError(f"sample {sample.id} has no image: the zoom environment needs a chest film")
        self.film = sample.images[0]

    def zoom(self, region: Literal[REGIONS]) -> list[dict]:
        """Enlarge one region of the chest film, to look at it more closely.

        Args:
            region: the region to enlarge: a lung, one of its upper, mid or lower zones (the patient's right lung is on the image left), the cardiac silhouette, the upper mediastinum or the trachea

        Returns:
            The enlarged region as an image, and a line saying which region it is.
        """
        if self.film is None:
            raise RuntimeError("zoom before reset: the environment has no film yet")
        width, height = self.film.size
        x1, y1, x2, y2 = zoom_box(region, width / height)
        pixels = (round(x1 * width), round(y1 * height), round(x2 * width), round(y2 * height))
        crop = self.film.crop(pixels).resize(self.film.size, Image.Resampling.BICUBIC)
        scale = width / (pixels[2] - pixels[0])
        return [{"type": "image", "image": crop},
                {"type": "text", "text": f"The {region}, enlarged {scale:.1f} times."}]
