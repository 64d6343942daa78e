"""The ``zoom`` tool (grouprl.domains.radiology.tools): the region of a synthetic study's film, enlarged."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from grouprl.data.sample import Sample
from grouprl.domains.radiology.synthetic.cxr import REGIONS, generate_study, region_boxes
from grouprl.domains.radiology.tools import ZoomEnvironment, zoom_box


def film_sample(image) -> Sample:
    return Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]}],
                  images=[image])


def zoom_on(image, region):
    environment = ZoomEnvironment()
    environment.reset(film_sample(image))
    return environment.zoom(region)


def test_each_zoom_box_holds_its_region_on_every_film():
    """The boxes come from the studies' geometry: on films of two seeds, with and without cardiomegaly,
    each region as drawn (region_boxes, from the film's own layout) lies inside the box zoom crops."""
    enlarged_hearts = 0
    for seed in (0, 7):
        for index in range(20):
            study = generate_study(index, seed=seed)
            enlarged_hearts += study.findings["cardiomegaly"] == 1
            for region, (x1, y1, x2, y2) in region_boxes(study.findings, study.layout).items():
                z1, w1, z2, w2 = zoom_box(region)
                assert z1 <= x1 and w1 <= y1 and x2 <= z2 and y2 <= w2, (study.id, region)
    assert enlarged_hearts > 0
    # square films get square boxes (the enlargement does not stretch); a wide film gets wide boxes
    for region in REGIONS:
        x1, y1, x2, y2 = zoom_box(region)
        assert x2 - x1 == pytest.approx(y2 - y1) and 0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1
    x1, y1, x2, y2 = zoom_box("trachea", aspect=2.0)
    assert (x2 - x1) * 2.0 == pytest.approx(y2 - y1)


def test_zoom_returns_the_region_enlarged_to_the_film_size_and_a_caption():
    # a black film with one bright square at the heart's place: the cardiac view shows it enlarged,
    # an upper lung zone's view does not show it at all
    film = Image.new("RGB", (112, 112), (0, 0, 0))
    film.paste((255, 255, 255), (56, 72, 66, 82))  # 10 x 10 pixels around (0.54, 0.68)
    image, caption = zoom_on(film, "cardiac silhouette")
    assert image["type"] == "image" and caption["type"] == "text"
    assert image["image"].size == film.size and image["image"].mode == "RGB"
    bright = (np.asarray(image["image"])[..., 0] > 128).sum()
    x1, _, x2, _ = zoom_box("cardiac silhouette")
    scale = 1 / (x2 - x1)
    assert bright == pytest.approx(100 * scale**2, rel=0.25)
    assert caption["text"] == f"The cardiac silhouette, enlarged {112 / round((x2 - x1) * 112):.1f} times."
    for region in ("right upper lung zone", "left upper lung zone"):
        assert (np.asarray(zoom_on(film, region)[0]["image"]) == 0).all()


def test_zoom_shows_the_anatomy_of_a_synthetic_film_and_is_deterministic():
    for index in range(4):
        film = generate_study(index, seed=0).image
        views = {region: np.asarray(zoom_on(film, region)[0]["image"], dtype=np.float32)
                 for region in ("right mid lung zone", "left mid lung zone", "cardiac silhouette")}
        # aerated lungs are darker than the dense heart on every film
        assert views["right mid lung zone"].mean() < views["cardiac silhouette"].mean()
        assert views["left mid lung zone"].mean() < views["cardiac silhouette"].mean()
        again = np.asarray(zoom_on(film, "cardiac silhouette")[0]["image"], dtype=np.float32)
        assert np.array_equal(again, views["cardiac silhouette"])


def test_unknown_regions_and_misuse_are_named():
    film = generate_study(0, seed=0).image
    with pytest.raises(ValueError, match=r"unknown region 'right lower lobe'; zoom takes one of: right lung, left lung"):
        zoom_on(film, "right lower lobe")
    with pytest.raises(RuntimeError, match="zoom before reset"):
        ZoomEnvironment().zoom("trachea")
    with pytest.raises(ValueError, match=r"sample .* has no image: the zoom environment needs a chest film"):
        ZoomEnvironment().reset(Sample(messages=[{"role": "user", "content": "Findings?"}]))


def test_zoom_has_a_tool_schema_and_its_result_enters_the_dialogue(cxr_vlm):
    from transformers import AutoProcessor

    from grouprl.rollout.tools import tool_schema
    from grouprl.rollout.turn_tokens import between_turns

    environment = ZoomEnvironment()
    schema = tool_schema(environment.zoom)["function"]
    assert schema["name"] == "zoom" and schema["parameters"]["required"] == ["region"]
    assert schema["parameters"]["properties"]["region"]["enum"] == list(REGIONS)

    processor = AutoProcessor.from_pretrained(cxr_vlm)
    environment.reset(film_sample(generate_study(1, seed=0).image))
    result = {"role": "tool", "name": "zoom", "content": environment.zoom("left lower lung zone")}
    between = between_turns(processor, [result], after_end_of_turn=True)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert between.ids.count(image_id) == int(between.model_inputs["image_grid_thw"].prod()) // 4
    assert "The left lower lung zone, enlarged" in processor.tokenizer.decode(between.ids)
