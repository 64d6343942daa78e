"""The coloured-squares task: prompts, ground-truth renders and a rule reward read from pixels.

A prompt asks for one or two squares of one colour in one half of the image:
"a red square on the left", "two blue squares at the top". ``render`` draws what a
prompt asks for (solid squares on a dark background, with small random jitter of
place and colour), so a flow model can be pretrained on (render, prompt) pairs, and
``shapes_reward`` scores any image against its prompt text, so the same model can
then be improved with RL against a reward that knows nothing of the renderer.

The reward is in [0, 1]; see ``score_image`` for its parts. Ground-truth renders
score 1.0 (up to jitter), an empty image 0, a square of the wrong colour or in the
wrong half 0, the wrong number of squares at most 0.25.

Held-out prompts are combinations of colour, position and count that the training
split never shows, while every single word still appears in training: a model that
does well on them composes what it learnt rather than recalling whole prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from PIL import Image

# Far apart in RGB (the closest pair, red and yellow, is 170 apart), so a pixel is
# read as a colour only when it is unambiguously that colour.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 210, 40),
}
BACKGROUND = (18, 18, 22)
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom")
# The demo's default: left/right only, 16 combinations, which a 0.6M-parameter
# model learns in a minute of CPU pretraining. Pass ``positions=POSITIONS`` for 32.
DEFAULT_POSITIONS: tuple[str, ...] = ("left", "right")
COUNTS: tuple[int, ...] = (1, 2)
SPLITS = ("train", "held_out")

_COUNT_WORDS = {1: "a", 2: "two"}
_PLACE_WORDS = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
_WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "1": 1, "two": 2, "2": 2}
_PROMPT_RE = re.compile(
    r"^\s*(?P<count>a|an|one|two|1|2)\s+(?P<colour>[a-z]+)\s+(?P<noun>squares?)\s+"
    r"(?:on|at|in)\s+the\s+(?P<position>left|right|top|bottom)(?:\s+(?:side|half))?\s*\.?\s*$",
    re.IGNORECASE,
)

# A pixel takes the label of the nearest reference colour (palette or background)
# only if it is within this RGB distance of it: half the closest palette pair's
# distance, so no pixel can be read as two colours. Blurred edges stay unlabelled.
_MATCH_DISTANCE = 85.0
_REFERENCES = np.array([BACKGROUND, *COLOURS.values()], dtype=np.float32)
_COLOUR_INDEX = {name: i + 1 for i, name in enumerate(COLOURS)}  # 0 is the background
# Squares found in the asked half beyond this much of the asked area count as stray.
_EXCESS_ALLOWANCE = 1.25


@dataclass(frozen=True)
class ShapeSpec:
    """What a prompt asks for: ``count`` squares of ``colour`` in the ``position`` half."""

    colour: str
    position: str
    count: int

    def __post_init__(self) -> None:
        if self.colour not in COLOURS:
            raise ValueError(f"ShapeSpec: colour {self.colour!r} is not one of {sorted(COLOURS)}")
        if self.position not in POSITIONS:
            raise ValueError(f"ShapeSpec: position {self.position!r} is not one of {POSITIONS}")
        if self.count not in COUNTS:
            raise ValueError(f"ShapeSpec: count {self.count!r} is not one of {COUNTS}")

    @property
    def prompt(self) -> str:
        noun = "square" if self.count == 1 else "squares"
        return f"{_COUNT_WORDS[self.count]} {self.colour} {noun} {_PLACE_WORDS[self.position]}"


def parse_prompt(prompt: str) -> ShapeSpec:
    """The ``ShapeSpec`` of a prompt's text ("two blue squares on the right", any case,
    "on"/"at"/"in the", an optional "side"/"half" and full stop); ValueError naming the
    prompt when it is not one."""
    match = _PROMPT_RE.match(prompt) if isinstance(prompt, str) else None
    if match is None:
        raise ValueError(f"shapes: cannot parse prompt {prompt!r}; expected e.g. "
                         f"'a red square on the left' or 'two blue squares at the top'")
    colour = match["colour"].lower()
    if colour not in COLOURS:
        raise ValueError(f"shapes: cannot parse prompt {prompt!r}: colour {colour!r} is not one of {sorted(COLOURS)}")
    return ShapeSpec(colour, match["position"].lower(), _WORD_COUNTS[match["count"].lower()])


def corpus() -> list[str]:
    """Every prompt of the task (all positions), for building a tokenizer over its words."""
    return [ShapeSpec(c, p, k).prompt for c in COLOURS for p in POSITIONS for k in COUNTS]


# ---------------------------------------------------------------- splits


def _held_out(positions: Sequence[str]) -> set[ShapeSpec]:
    # One combination per colour; stepping the count with the position's wrap-around
    # spreads them over different (position, count) pairs, so every colour, position
    # and count word still occurs in training, each in most of its combinations.
    held = set()
    for i, colour in enumerate(COLOURS):
        position = positions[i % len(positions)]
        count = COUNTS[(i + i // len(positions)) % len(COUNTS)]
        held.add(ShapeSpec(colour, position, count))
    return held


def prompt_specs(split: str = "train", *, positions: Sequence[str] = DEFAULT_POSITIONS) -> list[ShapeSpec]:
    """The combinations of a split, in a fixed order.

    ``held_out`` holds one (position, count) combination per colour (4 of the 16
    default combinations, 4 of 32 with all four positions); ``train`` holds the rest.
    """
    if split not in SPLITS:
        raise ValueError(f"shapes: split must be one of {SPLITS}, got {split!r}")
    positions = tuple(positions)
    unknown = [p for p in positions if p not in POSITIONS]
    if not positions or unknown or len(set(positions)) != len(positions):
        raise ValueError(f"shapes: positions must be distinct names from {POSITIONS}, got {positions}")
    every = [ShapeSpec(c, p, k) for c in COLOURS for p in positions for k in COUNTS]
    held = _held_out(positions)
    return [s for s in every if (s in held) == (split == "held_out")]


def make_prompts(n: int, seed: int, split: str = "train", *,
                 positions: Sequence[str] = DEFAULT_POSITIONS) -> list[str]:
    """``n`` prompts of ``split``, deterministic in ``seed``.

    Drawn as successive shuffles of the split's combinations, so every combination
    appears ``n // len(split)`` or one more times.
    """
    specs = prompt_specs(split, positions=positions)
    if n < 0:
        raise ValueError(f"shapes: n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < n:
        out += [specs[i].prompt for i in rng.permutation(len(specs))]
    return out[:n]


# ---------------------------------------------------------------- rendering


def square_side(size: int) -> int:
    """The side of a square in a ``size`` x ``size`` image: a quarter of it, so two fit in a half."""
    return max(2, size // 4)


def _region(position: str, height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the asked half."""
    return {
        "left": (0, 0, height, width // 2),
        "right": (0, width - width // 2, height, width),
        "top": (0, 0, height // 2, width),
        "bottom": (height - height // 2, 0, height, width),
    }[position]


def render(spec: ShapeSpec | str, size: int, rng: np.random.Generator) -> Image.Image:
    """The ground-truth ``size`` x ``size`` image of a prompt (its text or ``ShapeSpec``).

    The half is cut into ``count`` equal cells along its long side and one square is
    centred in each, moved by up to ``size // 16`` pixels (at least 1) each way and
    kept inside its cell, so two squares never touch. Each square's colour and the
    background's brightness are jittered a little.
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if size < 8:
        raise ValueError(f"shapes.render: size must be >= 8, got {size}")
    side = square_side(size)
    jitter = max(1, size // 16)
    canvas = np.empty((size, size, 3), dtype=np.int16)
    canvas[:] = np.array(BACKGROUND, dtype=np.int16) + int(rng.integers(-6, 7))
    top, left, bottom, right = _region(spec.position, size, size)
    vertical = spec.position in ("left", "right")  # the half is tall: stack cells vertically
    for i in range(spec.count):
        if vertical:
            step = (bottom - top) // spec.count
            cell = (top + i * step, left, top + (i + 1) * step, right)
        else:
            step = (right - left) // spec.count
            cell = (top, left + i * step, bottom, left + (i + 1) * step)
        y = _jittered(cell[0], cell[2], side, jitter, rng)
        x = _jittered(cell[1], cell[3], side, jitter, rng)
        colour = np.array(COLOURS[spec.colour], dtype=np.int16) + rng.integers(-20, 21, size=3)
        canvas[y:y + side, x:x + side] = colour
    return Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8), mode="RGB")


def _jittered(start: int, stop: int, side: int, jitter: int, rng: np.random.Generator) -> int:
    """The first coordinate of a square centred in [start, stop), moved by up to ``jitter``,
    kept at least a pixel inside when there is room."""
    centred = start + (stop - start - side) // 2
    margin = 1 if stop - start - side >= 2 else 0
    low, high = start + margin, stop - side - margin
    return int(np.clip(centred + rng.integers(-jitter, jitter + 1), low, max(low, high)))


def make_pairs(n: int, *, seed: int, size: int, split: str = "train",
               positions: Sequence[str] = DEFAULT_POSITIONS) -> list[tuple[Image.Image, str]]:
    """``n`` (ground-truth image, prompt) pairs of ``split``, deterministic in ``seed``: pretraining data."""
    prompts = make_prompts(n, seed, split, positions=positions)
    rng = np.random.default_rng([seed, 1])  # apart from the prompt stream
    return [(render(p, size, rng), p) for p in prompts]


# ---------------------------------------------------------------- reward


def _pixels(image: Any) -> np.ndarray:
    """An image as float RGB in [0, 255], H x W x 3: a PIL image, or an H x W x 3 array
    (uint8, or float in [0, 1])."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"shapes_reward: images must be PIL images or H x W x 3 arrays, got shape {array.shape}")
    if array.dtype == np.uint8:
        return array.astype(np.float32)
    return np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0


def label_pixels(pixels: np.ndarray) -> np.ndarray:
    """Per pixel: 0 background, ``i`` for the i-th colour of ``COLOURS`` (from 1), -1 none of them."""
    distances = np.linalg.norm(pixels[:, :, None, :] - _REFERENCES[None, None], axis=-1)
    nearest = distances.argmin(axis=-1)
    return np.where(distances.min(axis=-1) < _MATCH_DISTANCE, nearest, -1)


def count_components(mask: np.ndarray, min_size: int = 1) -> int:
    """Number of 4-connected groups of True pixels with at least ``min_size`` pixels.

    Each pixel starts with its own label and repeatedly takes the smallest label among
    itself and its neighbours; when nothing changes every group carries one label.
    (Numpy only: scipy is not a dependency.)
    """
    mask = np.asarray(mask, dtype=bool)
    if not mask.any():
        return 0
    height, width = mask.shape
    none = height * width  # larger than every pixel's label
    labels = np.where(mask, np.arange(height * width).reshape(height, width), none)
    while True:
        padded = np.pad(labels, 1, constant_values=none)
        smallest = np.minimum.reduce([padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1],
                                      padded[1:-1, :-2], padded[1:-1, 2:]])
        updated = np.where(mask, smallest, none)
        if np.array_equal(updated, labels):
            break
        labels = updated
    _, sizes = np.unique(labels[mask], return_counts=True)
    return int((sizes >= min_size).sum())


def score_image(image: Any, spec: ShapeSpec | str) -> float:
    """How well one image shows its prompt, in [0, 1].

    With A the area the asked squares would cover (count x side^2):
    coverage = target-colour pixels in the asked half / A (at most 1);
    stray = (target-colour pixels outside the half + pixels of the other colours
    anywhere + target pixels in the half beyond 1.25 A) / A (at most 1);
    reward = max(0, coverage - stray) x (1 if the asked half holds exactly ``count``
    target-colour groups of at least a quarter square each, else 0.5).
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    pixels = _pixels(image)
    height, width = pixels.shape[:2]
    labels = label_pixels(pixels)
    target = labels == _COLOUR_INDEX[spec.colour]
    others = (labels > 0) & ~target
    region = np.zeros((height, width), dtype=bool)
    top, left, bottom, right = _region(spec.position, height, width)
    region[top:bottom, left:right] = True

    side = square_side(min(height, width))
    area = spec.count * side * side
    inside = int((target & region).sum())
    coverage = min(1.0, inside / area)
    excess = max(0.0, inside - _EXCESS_ALLOWANCE * area)
    stray = min(1.0, (int((target & ~region).sum()) + int(others.sum()) + excess) / area)
    groups = count_components(target & region, min_size=max(1, side * side // 4))
    return max(0.0, coverage - stray) * (1.0 if groups == spec.count else 0.5)


def shapes_reward(images: Sequence[Any], prompts: Sequence[str], **metadata: Any) -> list[float]:
    """Scores in [0, 1] of ``images`` against their ``prompts`` (texts), one per image.

    ``metadata`` is accepted and ignored: the reward reads everything it needs from
    the prompt text and the pixels. An unparseable prompt is a ValueError naming it.
    """
    images, prompts = list(images), list(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"shapes_reward: {len(images)} images but {len(prompts)} prompts")
    return [score_image(image, parse_prompt(prompt)) for image, prompt in zip(images, prompts)]



# the flow demo's held-out table counts an image as drawn right from this score on
PASS_SCORE = 0.5


def shapes_metric(completions: Sequence[Any], references: Sequence[Any], *, prompts: Sequence[str],
                  **columns: Any) -> dict[str, float]:
    """The validation metric ``shapes``: the flow demo's held-out comparison, over every validation image.

    ``mean_reward`` = (1/N) sum_i s_i and ``pass_rate`` = (1/N) #{i : s_i >= PASS_SCORE}, with s_i the
    :func:`shapes_reward` of image i against its prompt (the demo table's "mean reward" and
    "reward >= 0.5"). ``references`` are not read: the prompt says what the image must show.
    """
    scores = shapes_reward(completions, prompts)
    if not scores:
        raise ValueError("no images to score")
    return {"mean_reward": sum(scores) / len(scores),
            "pass_rate": sum(s >= PASS_SCORE for s in scores) / len(scores)}
