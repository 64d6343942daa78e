"""The synthetic chest X-ray generator: determinism, priors, visible findings, reports, files."""

import json
import re

import numpy as np
import pytest
from PIL import Image

from grouprl.domains.radiology.synthetic.cxr import (
    FINDINGS,
    MAX_WORDS,
    MIN_WORDS,
    PRIORS,
    PROMPTS,
    corpus,
    generate_studies,
    render_image,
    sample_findings,
    sample_layout,
    write_dataset,
    write_report,
)
from grouprl.domains.radiology.findings import extract_findings

SIZE = 112


def pixels(image):
    return np.asarray(image, dtype=np.float32)[:, :, 0]


@pytest.fixture(scope="module")
def studies():
    return generate_studies(40, seed=3)


def test_studies_are_deterministic_under_seed(studies):
    again = generate_studies(40, seed=3)
    assert [s.report for s in again] == [s.report for s in studies]
    assert [s.findings for s in again] == [s.findings for s in studies]
    assert all(np.array_equal(pixels(a.image), pixels(b.image)) for a, b in zip(again, studies))
    # study i does not depend on how many are generated
    assert generate_studies(5, seed=3)[4].report == studies[4].report
    other = generate_studies(5, seed=4)
    assert [s.report for s in other] != [s.report for s in studies[:5]]
    assert len({s.id for s in studies}) == len(studies)


def test_study_shape(studies):
    for study in studies:
        assert isinstance(study.image, Image.Image)
        assert study.image.mode == "RGB" and study.image.size == (SIZE, SIZE)
        assert set(study.findings) == set(FINDINGS)
        assert set(study.findings.values()) <= {-1, 0, 1}
    assert generate_studies(1, seed=0, image_size=64)[0].image.size == (64, 64)


def test_findings_follow_their_priors_and_combine():
    n = 4000
    draws = [sample_findings(np.random.default_rng(np.random.SeedSequence([5, i]))) for i in range(n)]
    for name in FINDINGS:
        rate = sum(d[name] != 0 for d in draws) / n
        assert abs(rate - PRIORS[name]) < 0.03, (name, rate)
    normal = sum(all(v == 0 for v in d.values()) for d in draws) / n
    assert 0.14 < normal < 0.26
    assert any(d[name] == -1 for d in draws for name in FINDINGS)  # some hedged findings
    assert len({tuple(d.values()) for d in draws}) > 150  # many combinations


def _pair(name, seed, value=1):
    """The same film without and with one finding."""
    absent = {f: 0 for f in FINDINGS}
    present = dict(absent, **{name: value})
    return (pixels(render_image(absent, np.random.default_rng(seed))),
            pixels(render_image(present, np.random.default_rng(seed))))


@pytest.mark.parametrize("name", FINDINGS)
def test_each_finding_changes_the_film_visibly(name):
    for seed in range(4):
        before, after = _pair(name, seed)
        diff = np.abs(after - before)
        # Everything else being identical, the finding changes a region a small model can
        # see: at least 20 pixels (a 5-pixel disc) by at least 25 grey levels.
        assert (diff > 25).sum() >= 20, (name, seed, (diff > 25).sum())


def test_effusions_are_drawn_on_the_patients_side():
    # Radiology convention: the patient's left is on the image right.
    half = SIZE // 2
    for seed in range(4):
        before, left = _pair("left_effusion", seed)
        _, right = _pair("right_effusion", seed)
        base = slice(SIZE // 2, SIZE)
        assert np.abs(left - before)[base, half:].sum() > 5 * np.abs(left - before)[base, :half].sum()
        assert np.abs(right - before)[base, :half].sum() > 5 * np.abs(right - before)[base, half:].sum()


def test_findings_change_the_expected_region():
    for seed in range(3):
        layout = sample_layout(np.random.default_rng(seed))
        before, after = _pair("pneumothorax", seed)
        upper = slice(0, SIZE // 2)
        side = slice(SIZE // 2, SIZE) if layout.pneumothorax_side == "left" else slice(0, SIZE // 2)
        other = slice(0, SIZE // 2) if layout.pneumothorax_side == "left" else slice(SIZE // 2, SIZE)
        # air replaces lung: darker on the reported side, nothing on the other
        assert (before - after)[upper, side].mean() > 3
        assert np.abs(after - before)[upper, other].max() < 1
        before, after = _pair("cardiomegaly", seed)
        assert (after - before)[SIZE // 2 :, :].mean() > 2  # a wider, denser shadow low in the chest
        before, after = _pair("edema", seed)
        assert (after - before).mean() > 3  # haze brightens the lungs
        faint_before, faint = _pair("edema", seed, value=-1)
        assert 0 < (faint - faint_before).mean() < (after - before).mean()  # hedged findings are fainter


def test_reports_mention_findings_and_stay_short(studies):
    sentences = set(corpus())
    for study in studies:
        read = extract_findings(study.report)
        for name, value in study.findings.items():
            if value != 0:
                assert read[name] == value, (name, study.report)
            elif read[name] is not None:
                assert read[name] == 0
        assert MIN_WORDS <= len(study.report.split()) <= MAX_WORDS
        for sentence in re.split(r"(?<=\.) ", study.report):
            assert sentence in sentences, sentence


def test_reports_are_varied():
    layout_rng = np.random.default_rng(0)
    layout = sample_layout(layout_rng)
    findings = {name: 0 for name in FINDINGS}
    reports = {write_report(findings, layout, np.random.default_rng(i)) for i in range(30)}
    assert len(reports) > 20
    all_text = " ".join(corpus())
    for phrase in ("The heart is enlarged.", "Cardiomegaly.", "No pleural effusion.", "There is no pneumothorax.",
                   "without focal consolidation", "Possible small left pleural effusion.", "cannot be excluded",
                   "Lungs are clear.", "Heart size is normal.", "No pleural effusion or pneumothorax."):
        assert phrase in all_text, phrase
    for prompt in PROMPTS:
        assert prompt in corpus()


@pytest.mark.parametrize("format", ["llava", "easyr1"])
def test_write_dataset_round_trip(tmp_path, format):
    path = write_dataset(tmp_path / "data", 6, seed=9, format=format, name="train", prompts=PROMPTS)
    assert path.parent == tmp_path / "data"
    text = path.read_text()
    records = json.loads(text) if format == "llava" else [json.loads(line) for line in text.splitlines()]
    studies = generate_studies(6, seed=9)
    assert len(records) == 6
    for i, (record, study) in enumerate(zip(records, studies)):
        image = record["image"] if format == "llava" else record["images"][0]
        image_path = path.parent / image
        assert image_path.is_file()
        assert np.array_equal(pixels(Image.open(image_path).convert("RGB")), pixels(study.image))
        assert record["id"] == study.id and record["findings"] == study.findings
        if format == "llava":
            human, gpt = record["conversations"]
            assert human == {"from": "human", "value": "<image>\n" + PROMPTS[i % len(PROMPTS)]}
            assert gpt == {"from": "gpt", "value": study.report}
        else:
            assert record["problem"] == "<image>" + PROMPTS[i % len(PROMPTS)]
            assert record["answer"] == study.report
    # no temporary files left behind
    assert not [p for p in (tmp_path / "data").rglob(".*")]
    with pytest.raises(ValueError, match="format"):
        write_dataset(tmp_path, 1, seed=0, format="parquet")


# ---------------------------------------------------------------- boxes of the drawing (grounding tasks)


def _drawn(name, value, seed):
    """The film of one layout without and with one finding (same noise), and the finding's boxes."""
    from grouprl.domains.radiology.synthetic.cxr import finding_boxes, paint

    layout = sample_layout(np.random.default_rng(seed))
    absent = {f: 0 for f in FINDINGS}
    present = dict(absent, **{name: value})
    before = pixels(paint(absent, layout, np.random.default_rng(100 + seed), SIZE))
    after = pixels(paint(present, layout, np.random.default_rng(100 + seed), SIZE))
    return np.abs(after - before), finding_boxes(present, layout)[name], layout


@pytest.mark.parametrize("name,value", [(n, 1) for n in FINDINGS] +
                         [(n, -1) for n in FINDINGS if n not in ("cardiomegaly", "support_device")])
def test_finding_boxes_hold_what_is_drawn(name, value):
    from grouprl.domains.radiology.rewards.grounding import Box, box_iou

    for seed in range(4):
        diff, boxes, layout = _drawn(name, value, seed)
        assert boxes and all(0 <= b[0] < b[2] <= 1 and 0 <= b[1] < b[3] <= 1 for b in boxes)
        if name == "edema":
            assert len(boxes) == 2 and boxes[0][2] < 0.5 < boxes[1][0]  # one per lung, patient's right first
        if name == "support_device":
            assert len(boxes) == len(layout.devices)
        inside = np.zeros(diff.shape, bool)
        for x1, y1, x2, y2 in boxes:  # one film pixel of slack: the boxes are exact on a finer grid
            inside[max(0, int(y1 * SIZE) - 1):int(np.ceil(y2 * SIZE)) + 1,
                   max(0, int(x1 * SIZE) - 1):int(np.ceil(x2 * SIZE)) + 1] = True
        strong = diff > 0.5 * diff.max()
        assert not (strong & ~inside).any(), (name, seed)  # every clearly changed pixel is in a box
        assert diff[inside].sum() >= 0.9 * diff.sum(), (name, seed)  # and nearly all of the change
        # and the boxes are not loose: they hug the clearly changed region
        rows, cols = np.flatnonzero(strong.any(axis=1)), np.flatnonzero(strong.any(axis=0))
        changed = Box(cols[0] / SIZE, rows[0] / SIZE, (cols[-1] + 1) / SIZE, (rows[-1] + 1) / SIZE)
        union = Box(min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes),
                    max(b[3] for b in boxes))
        assert box_iou(changed, union) >= 0.5, (name, seed, box_iou(changed, union))


def test_nodule_box_is_the_drawn_disc():
    from grouprl.domains.radiology.synthetic.cxr import BOX_RESOLUTION, _nodule_center, finding_boxes

    for seed in range(5):
        layout = sample_layout(np.random.default_rng(seed))
        for value, radius in ((1, None), (-1, 0.027)):
            nx, ny, r = _nodule_center(layout)
            r = radius or r
            cx, cy = nx + layout.shift[0], ny + layout.shift[1]  # the film is drawn shifted by layout.shift
            (box,) = finding_boxes({"nodule": value}, layout)["nodule"]
            assert box == pytest.approx((cx - r, cy - r, cx + r, cy + r), abs=1.5 / BOX_RESOLUTION)


def test_region_boxes_follow_the_anatomy():
    from grouprl.domains.radiology.synthetic.cxr import REGIONS, region_boxes

    for seed in range(3):
        layout = sample_layout(np.random.default_rng(seed))
        normal = region_boxes({}, layout)
        assert list(normal) == list(REGIONS)
        assert normal["right lung"][2] < 0.5 < normal["left lung"][0]  # the patient's right on the image left
        for side in ("right", "left"):
            lung = normal[f"{side} lung"]
            zones = [normal[f"{side} {z} lung zone"] for z in ("upper", "mid", "lower")]
            assert zones[0][1] == lung[1] and zones[2][3] == lung[3]  # the zones split the lung's height
            assert zones[0][3] == zones[1][1] and zones[1][3] == zones[2][1]
            heights = [z[3] - z[1] for z in zones]
            assert max(heights) - min(heights) <= 2 / 400
        heart = normal["cardiac silhouette"]
        assert heart[0] < layout.heart[0] + layout.shift[0] < heart[2]
        big = region_boxes({"cardiomegaly": 1}, layout)["cardiac silhouette"]
        assert big[2] - big[0] > heart[2] - heart[0]  # drawn enlarged, boxed enlarged
        trachea = normal["trachea"]
        assert trachea[1] == 0.0 and abs((trachea[0] + trachea[2]) / 2 - 0.5 - layout.shift[0]) < 0.01


def test_report_task_output_is_unchanged_by_the_other_tasks(tmp_path):
    default = write_dataset(tmp_path / "a", 4, seed=2)
    named = write_dataset(tmp_path / "b", 4, seed=2, task="report", prompts=(PROMPTS[0],))
    write_dataset(tmp_path / "a", 4, seed=2, task="classification", name="classification")  # same directory
    assert default.read_text() == named.read_text() == write_dataset(tmp_path / "c", 4, seed=2).read_text()
    assert all(set(r) == {"id", "image", "conversations", "findings"} for r in json.loads(default.read_text()))
