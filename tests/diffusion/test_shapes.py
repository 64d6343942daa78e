"""The coloured-squares task (prompts, renders, rule reward) and rectified-flow pretraining on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from grouprl.domains.diffusion import shapes
from grouprl.domains.diffusion.shapes import ShapeSpec, count_components, parse_prompt, render, shapes_reward


@pytest.mark.parametrize("size", [16, 32])
def test_ground_truth_renders_score_high(size):
    rng = np.random.default_rng(0)
    prompts = shapes.make_prompts(64, 0, "train", positions=shapes.POSITIONS)
    prompts += shapes.make_prompts(16, 0, "held_out", positions=shapes.POSITIONS)
    scores = shapes_reward([render(p, size, rng) for p in prompts], prompts)
    assert np.mean(scores) > 0.8 and min(scores) > 0.5
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_wrong_colour_side_or_count_scores_low():
    rng = np.random.default_rng(1)
    image = render("two blue squares on the left", 16, rng)
    right, colour, side, vertical, count = shapes_reward(
        [image] * 5,
        ["two blue squares on the left", "two red squares on the left", "two blue squares on the right",
         "two blue squares at the bottom", "a blue square on the left"],
    )
    assert right > 0.8
    assert colour == 0.0 and side == 0.0 and vertical < 0.3 and count < 0.3
    one = render("a green square at the top", 16, rng)
    assert shapes_reward([one], ["two green squares at the top"])[0] < 0.5
    empty = Image.new("RGB", (16, 16), shapes.BACKGROUND)
    assert shapes_reward([empty], ["a red square on the left"]) == [0.0]
    # A stray square of another colour costs reward.
    pixels = np.asarray(render("a red square on the left", 16, rng)).copy()
    pixels[2:6, 10:14] = shapes.COLOURS["blue"]
    assert shapes_reward([pixels], ["a red square on the left"])[0] < 0.2


def test_parse_prompt_and_its_errors():
    assert parse_prompt("Two Yellow squares on the right side.") == ShapeSpec("yellow", "right", 2)
    assert parse_prompt(ShapeSpec("red", "top", 1).prompt) == ShapeSpec("red", "top", 1)
    with pytest.raises(ValueError, match="'a purple square on the left'"):
        shapes_reward([np.zeros((16, 16, 3), np.uint8)], ["a purple square on the left"])
    with pytest.raises(ValueError, match="'draw me a cat'"):
        shapes_reward([np.zeros((16, 16, 3), np.uint8)], ["draw me a cat"])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        shapes_reward([np.zeros((16, 16, 3), np.uint8)] * 2, ["a red square on the left"])


@pytest.mark.parametrize("positions", [shapes.DEFAULT_POSITIONS, shapes.POSITIONS])
def test_held_out_split_is_disjoint_and_training_keeps_every_word(positions):
    train = shapes.prompt_specs("train", positions=positions)
    held = shapes.prompt_specs("held_out", positions=positions)
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(shapes.COLOURS) * len(positions) * len(shapes.COUNTS)
    assert len(held) == len(shapes.COLOURS)
    # Every word of a held-out prompt is seen in training; only the combination is new.
    for axis in ("colour", "position", "count"):
        assert {getattr(s, axis) for s in held} <= {getattr(s, axis) for s in train}
    assert {s.colour for s in train} == set(shapes.COLOURS) and {s.position for s in train} == set(positions)
    # The held-out combinations spread over different (position, count) pairs.
    assert len({(s.position, s.count) for s in held}) == len(held)
    prompts = shapes.make_prompts(40, 3, "held_out", positions=positions)
    assert set(prompts) == {s.prompt for s in held}
    assert not set(prompts) & set(shapes.make_prompts(200, 3, "train", positions=positions))


def test_make_prompts_is_deterministic_and_balanced():
    a = shapes.make_prompts(36, 7)
    assert a == shapes.make_prompts(36, 7) and a != shapes.make_prompts(36, 8)
    counts = {p: a.count(p) for p in set(a)}
    assert len(counts) == 12 and set(counts.values()) == {3}
    with pytest.raises(ValueError, match="split"):
        shapes.make_prompts(4, 0, "test")


def test_count_components():
    mask = np.zeros((8, 8), bool)
    assert count_components(mask) == 0
    mask[0:2, 0:2] = True
    mask[5:8, 5:8] = True
    mask[0, 7] = True  # a speck
    assert count_components(mask) == 3
    assert count_components(mask, min_size=2) == 2
    mask[2:5, 1] = True
    mask[4, 1:6] = True  # joins the two squares
    assert count_components(mask, min_size=2) == 1


def test_render_keeps_squares_inside_the_asked_half():
    rng = np.random.default_rng(2)
    for spec in shapes.prompt_specs("train", positions=shapes.POSITIONS):
        for size in (16, 24, 32):
            labels = shapes.label_pixels(np.asarray(render(spec, size, rng), dtype=np.float32))
            ys, xs = np.nonzero(labels > 0)
            half = size // 2
            inside = {"left": xs < half, "right": xs >= half, "top": ys < half, "bottom": ys >= half}[spec.position]
            assert inside.all() and len(xs) == spec.count * shapes.square_side(size) ** 2


# ---------------------------------------------------------------- pretraining


@pytest.fixture(scope="module")
def pixel_model(tiny_pixel_flow):
    pytest.importorskip("diffusers")
    from grouprl.domains.diffusion.models import load_flow_model

    return load_flow_model(tiny_pixel_flow(seed=0))


def test_short_pretraining_lowers_the_loss(pixel_model):
    from grouprl.domains.diffusion.pretrain import pretrain_flow

    text_before = [p.clone() for p in pixel_model.text_encoders[0].parameters()]
    pairs = shapes.make_pairs(256, seed=0, size=16)
    losses = pretrain_flow(pixel_model, pairs, steps=60, batch_size=16, lr=1e-3, seed=0)
    assert len(losses) == 60 and all(np.isfinite(losses))
    # A broken gradient step (no update, wrong sign, detached target) leaves it flat or rising.
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    assert all(torch.equal(a, b) for a, b in zip(text_before, pixel_model.text_encoders[0].parameters()))
    assert not pixel_model.transformer.training


def test_sample_ode_is_seeded_and_guided(pixel_model):
    from grouprl.domains.diffusion.pretrain import sample_ode

    prompts = ["a red square on the left", "two blue squares on the right"]
    a = sample_ode(pixel_model, prompts, num_steps=3, seed=0)
    b = sample_ode(pixel_model, prompts, num_steps=3, seed=0, batch_size=1)
    assert [im.size for im in a] == [(16, 16)] * 2
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    guided = sample_ode(pixel_model, prompts, num_steps=3, seed=0, guidance_scale=3.0)
    assert not np.array_equal(np.asarray(guided[0]), np.asarray(a[0]))
    with pytest.raises(ValueError, match="multiples of 2"):
        sample_ode(pixel_model, prompts, num_steps=2, height=15, width=16)
