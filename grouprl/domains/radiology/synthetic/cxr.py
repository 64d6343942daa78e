"""Synthetic chest X-ray studies: procedural frontal films with visible findings and reports.

The demo and the tests need image-report pairs that a tiny vision-language model can
learn from on a CPU, with no downloads. Each study is a grayscale PA chest film drawn
from simple shapes (lungs, heart, mediastinum, ribs, diaphragm), with the findings of
``FINDINGS`` painted in when present, and a short reference report in varied
radiology phrasing (synonyms, negations, hedges) written from the same parameters.

Laterality follows radiology convention: the film is viewed as if facing the patient,
so the patient's LEFT is on the IMAGE RIGHT. ``left_effusion`` is drawn at the base of
the image-right lung, and "left" in a report means the patient's left.

Everything is deterministic under ``seed``: study ``i`` of a seed is the same whatever
``n`` is, and the image of a study does not depend on the random choices of its report.
"""

from __future__ import annotations

import itertools
import json
import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from PIL import Image

from grouprl.domains.radiology.findings import FINDING_NAMES
from grouprl.files import AtomicFile, write_text_atomic

FINDINGS: tuple[str, ...] = FINDING_NAMES

# Probability that a finding is present (positive or uncertain). With these the
# findings are independent and about 20% of studies are normal.
PRIORS: dict[str, float] = {
    "cardiomegaly": 0.25,
    "left_effusion": 0.18,
    "right_effusion": 0.18,
    "pneumothorax": 0.15,
    "nodule": 0.18,
    "consolidation": 0.20,
    "edema": 0.15,
    "support_device": 0.22,
}
# Findings that are sometimes drawn faint and reported with a hedge (label -1), and
# how often a present one is.
HEDGEABLE = ("left_effusion", "right_effusion", "pneumothorax", "nodule", "consolidation", "edema")
UNCERTAIN_RATE = 0.12

PROMPT = "Describe the findings of this chest X-ray."
PROMPTS: tuple[str, ...] = (
    PROMPT,
    "Write the findings section of the report for this chest radiograph.",
    "What are the findings on this chest X-ray?",
)


@dataclass
class Study:
    """One synthetic study: the film, its ground-truth labels, its reference report.

    ``findings`` maps every name of ``FINDINGS`` to 1 (present), 0 (absent) or -1
    (present but faint, and hedged in the report).
    """

    image: Image.Image
    findings: dict[str, int]
    report: str
    id: str
    layout: Layout | None = field(default=None, repr=False)


# ---------------------------------------------------------------- report templates

# Slot fillers. A template's slots are filled from the study's parameters when it is
# written, and with every filler when the corpus is enumerated.
FILLERS: dict[str, tuple[str, ...]] = {
    "side": ("left", "right"),
    "size": ("small", "moderate", "large"),
    "sev": ("mild", "moderate", "marked"),
    "sev_adv": ("mildly", "moderately", "markedly"),
    "edema_sev": ("mild", "moderate", "severe"),
    "mm": ("6", "8", "10", "12"),
    "zone": ("upper", "mid", "lower"),
    "lobe": ("upper", "lower"),
}

POSITIVE: dict[str, tuple[str, ...]] = {
    "cardiomegaly": (
        "The heart is enlarged.",
        "Cardiomegaly.",
        "{sev} cardiomegaly.",
        "{sev} enlargement of the cardiac silhouette.",
        "The cardiac silhouette is {sev_adv} enlarged.",
        "Enlarged cardiac silhouette.",
    ),
    "effusion": (  # one side; {side} is the patient's side
        "{size} {side} pleural effusion.",
        "There is a {size} {side} pleural effusion.",
        "{side} pleural effusion.",
        "{size} pleural effusion on the {side}.",
        "Blunting of the {side} costophrenic angle.",
    ),
    "pneumothorax": (
        "{size} {side} apical pneumothorax.",
        "There is a {size} {side} pneumothorax.",
        "{side} pneumothorax with a visible pleural line.",
        "{side} apical pneumothorax.",
    ),
    "nodule": (
        "{mm} mm nodule in the {side} {zone} lung.",
        "A nodule measuring {mm} mm projects over the {side} {zone} lung.",
        "Rounded nodular opacity in the {side} {zone} lung.",
        "Solitary pulmonary nodule in the {side} {zone} lung.",
    ),
    "consolidation": (
        "Consolidation in the {side} {lobe} lobe.",
        "Patchy airspace opacity in the {side} {lobe} lobe.",
        "{side} {lobe} lobe consolidation.",
        "Airspace consolidation in the {side} {lobe} lobe.",
    ),
    "edema": (
        "{edema_sev} pulmonary edema.",
        "Diffuse bilateral haziness consistent with pulmonary edema.",
        "Pulmonary vascular congestion and {edema_sev} interstitial edema.",
        "Findings consistent with {edema_sev} pulmonary edema.",
    ),
}
BOTH_EFFUSIONS = (
    "Bilateral pleural effusions.",
    "{size} bilateral pleural effusions.",
    "Left and right pleural effusions.",
    "Blunting of both costophrenic angles.",
)
DEVICE = {
    "ett": ("Endotracheal tube in standard position.", "The endotracheal tube terminates above the carina."),
    "line": ("Right internal jugular line ends in the superior vena cava.", "Right central venous catheter in place."),
    "pacemaker": ("Left chest wall pacemaker with leads in the heart.", "Cardiac pacemaker in place."),
    "ng": ("Enteric tube courses below the diaphragm.", "Nasogastric tube tip in the stomach."),
    "generic": ("Support devices in place.", "Lines and tubes in place."),
}
UNCERTAIN: dict[str, tuple[str, ...]] = {
    "effusion": (
        "Possible small {side} pleural effusion.",
        "A small {side} effusion cannot be excluded.",
        "Questionable blunting of the {side} costophrenic angle.",
    ),
    "pneumothorax": (
        "Possible small {side} apical pneumothorax.",
        "A tiny {side} pneumothorax cannot be excluded.",
    ),
    "nodule": (
        "Possible small nodule in the {side} {zone} lung.",
        "Questionable nodular opacity in the {side} {zone} lung.",
    ),
    "consolidation": (
        "Possible early consolidation in the {side} {lobe} lobe.",
        "Subtle opacity in the {side} {lobe} lobe, cannot exclude consolidation.",
    ),
    "edema": ("Possible mild pulmonary edema.", "Mild interstitial edema cannot be excluded."),
}
BOTH_EFFUSIONS_UNCERTAIN = ("Possible small bilateral pleural effusions.",)
NEGATIVE: dict[str, tuple[str, ...]] = {
    "cardiomegaly": (
        "Heart size is normal.",
        "Normal heart size.",
        "The heart is not enlarged.",
        "The cardiac silhouette is within normal limits.",
        "No cardiomegaly.",
    ),
    "effusion": (  # both sides absent
        "No pleural effusion.",
        "No pleural effusions.",
        "The costophrenic angles are sharp.",
        "There is no pleural effusion.",
    ),
    "side_effusion": ("No {side} pleural effusion.", "No {side} effusion.", "The {side} costophrenic angle is sharp."),
    "pneumothorax": ("No pneumothorax.", "There is no pneumothorax.", "No evidence of pneumothorax.", "Pneumothorax is not seen."),
    "nodule": ("No pulmonary nodules.", "No suspicious pulmonary nodule.", "No nodule or mass."),
    "consolidation": ("No focal consolidation.", "There is no consolidation.", "No airspace consolidation."),
    "edema": ("No pulmonary edema.", "There is no edema.", "No vascular congestion or edema."),
    "support_device": ("No lines or tubes.", "No support devices.", "No indwelling lines or tubes."),
}
# Only when no lung finding (nodule, consolidation, edema, pneumothorax) is present.
CLEAR_LUNGS = ("Lungs are clear without focal consolidation.",)
# Noun phrases for list negations ("No pleural effusion or pneumothorax."), in report order.
LIST_ITEMS: dict[str, tuple[str, ...]] = {
    "cardiomegaly": ("cardiomegaly",),
    "consolidation": ("focal consolidation", "consolidation"),
    "nodule": ("pulmonary nodule",),
    "edema": ("pulmonary edema", "edema"),
    "effusion": ("pleural effusion", "effusion"),
    "left_effusion": ("left pleural effusion", "left effusion"),
    "right_effusion": ("right pleural effusion", "right effusion"),
    "pneumothorax": ("pneumothorax",),
}
LIST_FRAMES = ("No {items}.", "There is no {items}.", "No evidence of {items}.")
LIST_MAX = 3
FILLER = {
    "normal": ("No acute cardiopulmonary process.",),
    "lungs": ("Lungs are clear.", "The lungs are well expanded."),
    "mediastinum": ("The mediastinal contours are normal.",),
    "bones": ("No acute osseous abnormality.",),
}
MIN_WORDS, MAX_WORDS = 15, 45


def _slots(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _sentence(template: str, **values: str) -> str:
    text = template.format(**values)
    return text[0].upper() + text[1:]


def _expand(template: str) -> Iterator[str]:
    slots = _slots(template)
    for combo in itertools.product(*(FILLERS[s] for s in slots)):
        yield _sentence(template, **dict(zip(slots, combo)))


def _join(items: Sequence[str], oxford: bool) -> str:
    if len(items) == 2:
        return f"{items[0]} or {items[1]}"
    return ", ".join(items[:-1]) + ("," if oxford else "") + f" or {items[-1]}"


def _list_sentences(keys: Sequence[str]) -> Iterator[str]:
    """Every list negation over the keys (2 to LIST_MAX of them, in report order)."""
    for k in range(2, LIST_MAX + 1):
        for subset in itertools.combinations(keys, k):
            # Sided and unsided effusion never share a list: a study has one or the other.
            if "effusion" in subset and ("left_effusion" in subset or "right_effusion" in subset):
                continue
            if "left_effusion" in subset and "right_effusion" in subset:
                continue
            for nouns in itertools.product(*(LIST_ITEMS[key] for key in subset)):
                for oxford in (False, True) if k > 2 else (False,):
                    for frame in LIST_FRAMES:
                        yield _sentence(frame, items=_join(nouns, oxford))


def corpus() -> list[str]:
    """Every sentence a report can contain, every slot filled every way, and the prompts.

    The demo trains its tokenizer on this, so that the tokenizer covers every word
    the generator can write.
    """
    templates: list[str] = []
    for group in (POSITIVE, UNCERTAIN, NEGATIVE, DEVICE, FILLER):
        for ts in group.values():
            templates += ts
    templates += BOTH_EFFUSIONS + BOTH_EFFUSIONS_UNCERTAIN + CLEAR_LUNGS
    sentences = [s for t in templates for s in _expand(t)]
    sentences += _list_sentences(list(LIST_ITEMS))
    return list(dict.fromkeys(sentences + list(PROMPTS)))


# ---------------------------------------------------------------- writing a report


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _grade_words(layout: Layout) -> dict[str, str]:
    return {
        "sev": FILLERS["sev"][layout.cardiomegaly_grade],
        "sev_adv": FILLERS["sev_adv"][layout.cardiomegaly_grade],
        "edema_sev": FILLERS["edema_sev"][layout.edema_grade],
        "mm": FILLERS["mm"][layout.nodule_grade],
    }


def write_report(findings: dict[str, int], layout: Layout, rng: np.random.Generator) -> str:
    """A reference report for a study: every present finding described, most absent
    ones negated (singly or in a list), phrasing drawn at random from the templates."""
    words = _grade_words(layout)
    positives: list[str] = []
    negatives: list[str] = []  # sentences that may be dropped to respect MAX_WORDS
    negated: list[str] = []  # keys of LIST_ITEMS / NEGATIVE still to be written

    def fill(template: str, **values: str) -> str:
        slots = {**words, **values}
        return _sentence(template, **{s: slots[s] for s in _slots(template)})

    # Support devices first, as radiologists list lines and tubes first.
    if findings["support_device"] == 1:
        if len(layout.devices) > 1 and rng.random() < 0.4:
            positives.append(_pick(rng, DEVICE["generic"]))
        else:
            positives += [_pick(rng, DEVICE[d]) for d in layout.devices]
    elif rng.random() < 0.6:
        negatives.append(_pick(rng, NEGATIVE["support_device"]))

    if findings["cardiomegaly"] == 1:
        positives.append(fill(_pick(rng, POSITIVE["cardiomegaly"])))
    elif rng.random() < 0.85:
        negated.append("cardiomegaly")

    for name, where in (("consolidation", {"side": layout.consolidation_side, "lobe": layout.consolidation_lobe}),
                        ("nodule", {"side": layout.nodule_side, "zone": layout.nodule_zone}),
                        ("edema", {})):
        status = findings[name]
        if status == 1:
            positives.append(fill(_pick(rng, POSITIVE[name]), **where))
        elif status == -1:
            positives.append(fill(_pick(rng, UNCERTAIN[name]), **where))
        elif rng.random() < 0.85:
            negated.append(name)

    positives += _effusion_sentences(findings, layout, rng, negated, fill)

    status = findings["pneumothorax"]
    where = {"side": layout.pneumothorax_side, "size": FILLERS["size"][layout.pneumothorax_grade]}
    if status == 1:
        positives.append(fill(_pick(rng, POSITIVE["pneumothorax"]), **where))
    elif status == -1:
        positives.append(fill(_pick(rng, UNCERTAIN["pneumothorax"]), **where))
    elif rng.random() < 0.85:
        negated.append("pneumothorax")

    negatives += _negation_sentences(negated, findings, rng, fill)
    rng.shuffle(negatives)
    sentences = positives + negatives

    # Keep reports short for the tiny demo model: drop negations first, never a positive.
    while _count(sentences) > MAX_WORDS and negatives:
        drop = negatives.pop()
        sentences.remove(drop)
    lungs_clear = all(findings[n] == 0 for n in ("nodule", "consolidation", "edema", "pneumothorax"))
    # Statements of normal anatomy that name no finding, only to bring a terse report up
    # to MIN_WORDS; and, for half the normal studies, an impression-like closing line.
    padding = []
    if lungs_clear and not any(s.startswith("Lungs are clear") for s in sentences):
        padding.append(_pick(rng, FILLER["lungs"]))
    if findings["cardiomegaly"] == 0:
        padding.append(FILLER["mediastinum"][0])
    padding.append(FILLER["bones"][0])
    for sentence in padding:
        if _count(sentences) >= MIN_WORDS:
            break
        sentences.append(sentence)
    pathology_free = all(findings[n] == 0 for n in FINDINGS if n != "support_device")
    if pathology_free and rng.random() < 0.5 and _count(sentences) + 4 <= MAX_WORDS:
        sentences.append(FILLER["normal"][0])
    return " ".join(sentences)


def _count(sentences: Sequence[str]) -> int:
    return sum(len(s.split()) for s in sentences)


def _effusion_sentences(findings, layout, rng, negated, fill) -> list[str]:
    left, right = findings["left_effusion"], findings["right_effusion"]
    out: list[str] = []
    if left == right == 1 and rng.random() < 0.6:
        size = FILLERS["size"][max(layout.effusion_grade["left"], layout.effusion_grade["right"])]
        return [fill(_pick(rng, BOTH_EFFUSIONS), size=size)]
    if left == right == -1 and rng.random() < 0.6:
        return [_pick(rng, BOTH_EFFUSIONS_UNCERTAIN)]
    if left == right == 0:
        if rng.random() < 0.85:
            negated.append("effusion")
        return out
    for side, status in (("left", left), ("right", right)):
        size = FILLERS["size"][layout.effusion_grade[side]]
        if status == 1:
            out.append(fill(_pick(rng, POSITIVE["effusion"]), side=side, size=size))
        elif status == -1:
            out.append(fill(_pick(rng, UNCERTAIN["effusion"]), side=side))
        elif rng.random() < 0.7:
            negated.append(f"{side}_effusion")
    return out


def _negation_sentences(negated: list[str], findings, rng, fill) -> list[str]:
    """Negations of the absent findings: some gathered into one list sentence."""
    out: list[str] = []
    keys = [k for k in LIST_ITEMS if k in negated]  # report order
    if len(keys) >= 2 and rng.random() < 0.6:
        k = int(rng.integers(2, min(LIST_MAX, len(keys)) + 1))
        chosen = sorted(rng.choice(len(keys), size=k, replace=False))
        listed = [keys[i] for i in chosen]
        nouns = [_pick(rng, LIST_ITEMS[key]) for key in listed]
        out.append(_sentence(_pick(rng, LIST_FRAMES), items=_join(nouns, oxford=bool(rng.random() < 0.5))))
        keys = [k for k in keys if k not in listed]
    lungs_clear = all(findings[n] == 0 for n in ("nodule", "consolidation", "edema", "pneumothorax"))
    for key in keys:
        if key.endswith("_effusion"):
            out.append(fill(_pick(rng, NEGATIVE["side_effusion"]), side=key.split("_")[0]))
        elif key == "consolidation" and lungs_clear and rng.random() < 0.4:
            out.append(CLEAR_LUNGS[0])
        else:
            out.append(_pick(rng, NEGATIVE[key]))
    return out


def finding_sentence(name: str, status: int, layout: Layout, rng: np.random.Generator, *,
                     device: str | None = None) -> str:
    """One report sentence for one present finding (``status`` 1, or -1 hedged), in the
    reports' own phrasing and with the film's sides, sites and grades; ``device`` names
    which support device (one of ``layout.devices``) a ``support_device`` sentence is about."""
    if status not in (1, -1):
        raise ValueError(f"finding_sentence: {name} must be present (1 or -1), got {status!r}")
    if name == "support_device":
        if device not in layout.devices:
            raise ValueError(f"finding_sentence: device must be one of the film's {layout.devices}, got {device!r}")
        return _pick(rng, DEVICE[device])
    key = "effusion" if name.endswith("_effusion") else name
    where: dict[str, str] = {}
    if key == "effusion":
        side = name.split("_")[0]
        where = {"side": side, "size": FILLERS["size"][layout.effusion_grade[side]]}
    elif key == "pneumothorax":
        where = {"side": layout.pneumothorax_side, "size": FILLERS["size"][layout.pneumothorax_grade]}
    elif key == "nodule":
        where = {"side": layout.nodule_side, "zone": layout.nodule_zone}
    elif key == "consolidation":
        where = {"side": layout.consolidation_side, "lobe": layout.consolidation_lobe}
    templates = UNCERTAIN[key] if status == -1 and key in UNCERTAIN else POSITIVE[key]
    template = _pick(rng, templates)
    slots = {**_grade_words(layout), **where}
    return _sentence(template, **{s: slots[s] for s in _slots(template)})


# ---------------------------------------------------------------- the film
#
# Coordinates are fractions of the image: x to the image right (the patient's left),
# y down. Intensities are in [0, 1], 0 black (air), 1 white (metal). Every shape has a
# soft edge one render pixel wide, and the film is drawn at twice the output size and
# averaged down, so thin lines (vessels, tubes, the pleural line) survive at 112 px.

_SUPERSAMPLE = 2
SIDES = ("left", "right")  # the patient's sides
DEVICES = ("ett", "line", "pacemaker", "ng")


@dataclass
class Layout:
    """Everything random about one film, drawn whatever the findings are.

    Drawing every parameter always (for absent findings too) keeps the generator's
    stream aligned: the same seed with one finding switched gives the same anatomy.
    The report reads the grades, sides and sites from here, so it matches the film.
    """

    shift: tuple[float, float]
    lungs: dict[str, tuple[float, float, float, float]]  # side -> cx, cy, rx, ry
    dome: dict[str, float]  # side -> top of the hemidiaphragm
    heart: tuple[float, float, float, float]  # cx, cy, rx (normal), ry
    rib_start: float
    rib_step: float
    vessels: dict[str, np.ndarray]  # side -> rows of (angle, length, intensity)
    tissue: float
    lung_dark: float
    gain: float
    gamma: float
    noise: float
    cardiomegaly_grade: int
    effusion_grade: dict[str, int]
    pneumothorax_side: str
    pneumothorax_grade: int
    nodule_side: str
    nodule_zone: str
    nodule_grade: int
    nodule_offset: tuple[float, float]
    consolidation_side: str
    consolidation_lobe: str
    consolidation_blobs: np.ndarray  # rows of (dx, dy, sigma)
    edema_grade: int
    devices: tuple[str, ...]


def sample_layout(rng: np.random.Generator) -> Layout:
    """Draw the anatomy, its jitter and the parameters of every finding."""
    u = rng.uniform
    lungs = {
        # The patient's right lung is on the image left, and a little larger.
        "right": (0.30 + u(-0.012, 0.012), 0.46 + u(-0.015, 0.015), 0.165 + u(-0.01, 0.01), 0.31 + u(-0.015, 0.015)),
        "left": (0.70 + u(-0.012, 0.012), 0.47 + u(-0.015, 0.015), 0.155 + u(-0.01, 0.01), 0.30 + u(-0.015, 0.015)),
    }
    dome = {"right": 0.66 + u(-0.02, 0.02), "left": 0.69 + u(-0.02, 0.02)}
    heart = (0.535 + u(-0.01, 0.01), 0.66 + u(-0.015, 0.015), 0.125 + u(-0.008, 0.008), 0.125 + u(-0.01, 0.01))
    vessels = {side: np.column_stack([u(0, 1, 12), u(0.1, 0.22, 12), u(0.08, 0.13, 12)]) for side in SIDES}
    n_devices = 1 + int(rng.random() < 0.3)
    devices = tuple(sorted(rng.choice(len(DEVICES), size=n_devices, replace=False)))
    return Layout(
        shift=(u(-0.02, 0.02), u(-0.02, 0.02)),
        lungs=lungs,
        dome=dome,
        heart=heart,
        rib_start=u(0.13, 0.17),
        rib_step=u(0.062, 0.07),
        vessels=vessels,
        tissue=u(0.40, 0.48),
        lung_dark=u(0.10, 0.16),
        gain=u(0.9, 1.1),
        gamma=u(0.85, 1.15),
        noise=u(0.015, 0.035),
        cardiomegaly_grade=int(rng.integers(3)),
        effusion_grade={side: int(rng.integers(3)) for side in SIDES},
        pneumothorax_side=SIDES[int(rng.integers(2))],
        pneumothorax_grade=int(rng.integers(3)),
        nodule_side=SIDES[int(rng.integers(2))],
        nodule_zone=FILLERS["zone"][int(rng.integers(3))],
        nodule_grade=int(rng.integers(4)),
        nodule_offset=(u(-0.1, 0.45), u(-0.03, 0.03)),  # lateral positive: clear of the heart
        consolidation_side=SIDES[int(rng.integers(2))],
        consolidation_lobe=FILLERS["lobe"][int(rng.integers(2))],
        consolidation_blobs=np.column_stack([u(-0.06, 0.06, 6), u(-0.05, 0.05, 6), u(0.025, 0.05, 6)]),
        edema_grade=int(rng.integers(3)),
        devices=tuple(DEVICES[i] for i in devices),
    )


def _soft(signed_distance: np.ndarray, width: float) -> np.ndarray:
    """1 inside a shape (negative distance), 0 outside, with a smooth edge of ``width``."""
    return 0.5 * (1.0 - np.tanh(signed_distance / width))


def _ellipse(x, y, cx, cy, rx, ry):
    """An approximate signed distance to an ellipse (exact on circles)."""
    return (np.sqrt(((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2) - 1.0) * min(rx, ry)


def _polyline_distance(x, y, points: Sequence[tuple[float, float]]) -> np.ndarray:
    best = np.full(x.shape, np.inf, dtype=np.float32)
    for (x0, y0), (x1, y1) in zip(points[:-1], points[1:]):
        dx, dy = x1 - x0, y1 - y0
        t = np.clip(((x - x0) * dx + (y - y0) * dy) / max(dx * dx + dy * dy, 1e-12), 0.0, 1.0)
        best = np.minimum(best, np.hypot(x - (x0 + t * dx), y - (y0 + t * dy)))
    return best


def _curve(p0, p1, p2, n: int = 16) -> list[tuple[float, float]]:
    """Points of a quadratic Bezier curve: catheters and tubes bend smoothly."""
    t = np.linspace(0.0, 1.0, n)
    pts = np.outer((1 - t) ** 2, p0) + np.outer(2 * (1 - t) * t, p1) + np.outer(t**2, p2)
    return [tuple(p) for p in pts]


def _lung_mask(x, y, layout: Layout, side: str, px: float) -> np.ndarray:
    cx, cy, rx, ry = layout.lungs[side]
    # The lung ends at the dome of the hemidiaphragm, which falls away laterally into
    # the costophrenic angle: an effusion fills that angle first.
    dome = layout.dome[side] + 3.5 * (x - cx) ** 2
    return _soft(_ellipse(x, y, cx, cy, rx, ry), px) * _soft(y - dome, px)


def paint(findings: dict[str, int], layout: Layout, rng: np.random.Generator, size: int = 112) -> Image.Image:
    """Draw the film of ``layout`` with ``findings`` (1 present, -1 present but faint)."""
    n = size * _SUPERSAMPLE
    px = 1.0 / n
    coords = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = np.meshgrid(coords - layout.shift[0], coords - layout.shift[1])

    # Body: soft tissue inside a broad ellipse (neck to abdomen) on a black background.
    body = _soft(_ellipse(x, y, 0.5, 0.62, 0.47, 0.64), 3 * px)
    img = 0.03 + (layout.tissue - 0.03) * body

    lungs = {side: _lung_mask(x, y, layout, side, 1.5 * px) for side in SIDES}
    both = np.maximum(lungs["left"], lungs["right"])
    # Apices overlap shoulder soft tissue and look a little brighter than the bases.
    lung_value = layout.lung_dark + 0.06 * np.clip(0.45 - y, 0, None) / 0.45
    img = img * (1 - both) + lung_value * both

    img += _vessels(x, y, layout, lungs, px)
    img, heart = _heart(img, x, y, layout, findings["cardiomegaly"] == 1, px)
    # Lung findings behind the dense heart show, but faintly (a projection of both).
    visible = 1.0 - 0.65 * heart
    strength = {name: (0.0 if v == 0 else 1.0 if v == 1 else 0.55) for name, v in findings.items()}

    if strength["edema"]:
        img += strength["edema"] * both * (1.0 - heart) * _edema(x, y, layout)
    if strength["consolidation"]:
        img += strength["consolidation"] * lungs[layout.consolidation_side] * visible * _consolidation(x, y, layout, px)
    if strength["nodule"]:
        img += strength["nodule"] * visible * _nodule(x, y, layout, findings["nodule"] == -1, px)
    if strength["pneumothorax"]:
        img = _pneumothorax(img, x, y, layout, lungs, findings["pneumothorax"] == -1, px)
    for side in SIDES:
        s = strength[f"{side}_effusion"]
        if s:
            grade = 0 if findings[f"{side}_effusion"] == -1 else layout.effusion_grade[side]
            fluid = lungs[side] * _effusion(x, y, layout, side, grade, px)
            img = img * (1 - s * fluid) + (layout.tissue + 0.1) * s * fluid

    img = _mediastinum(img, x, y, layout, px)
    img += 0.07 * body * _ribs(x, y, layout, px)
    if strength["support_device"]:
        img = np.maximum(img, _devices(x, y, layout, px))

    # Down to the output size, then film and detector variation: exposure, gamma, noise.
    img = img.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))
    img = np.clip(img * layout.gain, 0, 1) ** layout.gamma
    img = img + rng.normal(0.0, layout.noise, img.shape)
    gray = (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")


def _box(x, y, x0: float, x1: float, y0: float, y1: float) -> tuple[slice, slice]:
    """The rows and columns of the grid inside a rectangle: small shapes are drawn on a
    window of the film, not the whole of it (the vessels dominate the cost otherwise)."""
    cols, rows = x[0], y[:, 0]
    c0, c1 = np.searchsorted(cols, [min(x0, x1), max(x0, x1)])
    r0, r1 = np.searchsorted(rows, [min(y0, y1), max(y0, y1)])
    return slice(r0, r1 + 1), slice(c0, c1 + 1)


def _vessels(x, y, layout: Layout, lungs, px: float) -> np.ndarray:
    """Lung markings: thin lines fanning out from each hilum, tapering peripherally."""
    out = np.zeros_like(x)
    for side in SIDES:
        cx, cy, rx, ry = layout.lungs[side]
        outward = 1.0 if side == "left" else -1.0  # the lateral direction on the image
        hx, hy = cx - outward * 0.45 * rx, cy + 0.02
        for frac, length, value in layout.vessels[side]:
            angle = np.deg2rad(-70 + 150 * frac)  # from down-and-out to up-and-out
            ex, ey = hx + outward * length * np.cos(angle), hy - length * np.sin(angle) * 1.3
            win = _box(x, y, min(hx, ex) - 3 * px, max(hx, ex) + 3 * px, min(hy, ey) - 3 * px, max(hy, ey) + 3 * px)
            wx, wy = x[win], y[win]
            d = _polyline_distance(wx, wy, [(hx, hy), (ex, ey)])
            along = np.clip(np.hypot(wx - hx, wy - hy) / (1.3 * length), 0, 1)
            out[win] += value * (1 - 0.7 * along) * _soft(d - 0.8 * px, px) * lungs[side][win]
    # Where the lines meet at the hilum their sum would make a bright dot.
    return np.minimum(out, 0.15)


def _edema(x, y, layout: Layout) -> np.ndarray:
    """Diffuse haziness of both lungs, densest around the hila (a bat-wing pattern)."""
    level = (0.10, 0.15, 0.20)[layout.edema_grade]
    hila = sum(
        np.exp(-((x - (cx + (-0.4 if s == "left" else 0.4) * rx)) ** 2 + (y - cy) ** 2) / (2 * 0.12**2))
        for s, (cx, cy, rx, _) in layout.lungs.items()
    )
    return level * (0.6 + 0.8 * hila)


def _consolidation(x, y, layout: Layout, px: float) -> np.ndarray:
    """A patchy bright area: overlapping blobs in the upper or lower part of one lung."""
    cx, cy, rx, ry = layout.lungs[layout.consolidation_side]
    # Lateral of the lung's centre line, so that an enlarged heart does not hide it.
    ccx = cx + (0.2 if layout.consolidation_side == "left" else -0.2) * rx
    ccy = cy + (-0.45 if layout.consolidation_lobe == "upper" else 0.35) * ry
    patch = np.zeros_like(x)
    for dx, dy, sigma in layout.consolidation_blobs:
        patch = np.maximum(patch, np.exp(-((x - ccx - dx) ** 2 + (y - ccy - dy) ** 2) / (2 * sigma**2)))
    return 0.32 * np.clip(1.4 * patch, 0, 1)


def _nodule_center(layout: Layout) -> tuple[float, float, float]:
    cx, cy, rx, ry = layout.lungs[layout.nodule_side]
    zy = {"upper": -0.45, "mid": 0.0, "lower": 0.38}[layout.nodule_zone]
    radius = 0.03 + 0.007 * layout.nodule_grade
    lateral = 1.0 if layout.nodule_side == "left" else -1.0
    return cx + lateral * layout.nodule_offset[0] * rx, cy + zy * ry + layout.nodule_offset[1], radius


def _nodule(x, y, layout: Layout, faint: bool, px: float) -> np.ndarray:
    """A small bright round spot with a soft edge."""
    nx, ny, radius = _nodule_center(layout)
    if faint:
        radius = 0.027
    return 0.42 * _soft(np.hypot(x - nx, y - ny) - radius, 1.5 * px)


def _pneumothorax(img, x, y, layout: Layout, lungs, faint: bool, px: float) -> np.ndarray:
    """Air around a collapsed apex: a black rim without markings, bounded by the thin
    bright pleural line of the lung's edge."""
    air, line = _pneumothorax_layers(x, y, layout, lungs, faint, px)
    img = img * (1 - air) + 0.02 * air
    return img + 0.22 * line


def _pneumothorax_layers(x, y, layout: Layout, lungs, faint: bool, px: float) -> tuple[np.ndarray, np.ndarray]:
    """The pleural air and the pleural line of a pneumothorax, each 0 to 1."""
    side = layout.pneumothorax_side
    cx, cy, rx, ry = layout.lungs[side]
    gap = 0.0 if faint else (0.0, 0.06, 0.12)[layout.pneumothorax_grade]
    shrink = 0.05 + gap  # how far the lung edge has fallen away from the chest wall
    medial = -1.0 if side == "left" else 1.0
    edge = _ellipse(x, y, cx + medial * 0.4 * shrink, cy + 0.6 * shrink, rx - 0.5 * shrink, ry - shrink)
    # Only the upper, lateral part of the pleural space fills with air.
    upper = _soft(y - (cy + 0.05), 4 * px)
    air = lungs[side] * _soft(-edge, px) * upper
    line = _soft(np.abs(edge) - 0.6 * px, px) * lungs[side] * upper
    return air, line


def _effusion(x, y, layout: Layout, side: str, grade: int, px: float) -> np.ndarray:
    """Fluid at the lung base: a meniscus climbing the lateral chest wall."""
    cx, cy, rx, ry = layout.lungs[side]
    depth = (0.13, 0.18, 0.24)[grade]
    lateral = cx + (rx if side == "left" else -rx)
    t = np.clip(np.abs(x - lateral) / (2 * rx), 0, 1)
    surface = layout.dome[side] + 0.04 - depth * (1 - 0.5 * np.sqrt(t))
    return _soft(surface - y, 1.5 * px)


def _heart(img, x, y, layout: Layout, enlarged: bool, px: float) -> np.ndarray:
    """The cardiac shadow, drawn before the lung findings so that densities behind the
    heart (a retrocardiac nodule or consolidation) still add to it, as in a projection."""
    cx, cy, rx, ry = layout.heart
    if enlarged:
        # Cardiothoracic ratio from about 0.3 to about 0.5; the heart grows mostly to the
        # patient's left (image right).
        grow = (0.05, 0.07, 0.09)[layout.cardiomegaly_grade]
        rx, cx, ry = rx + grow, cx + 0.5 * grow, ry + 0.3 * grow
    heart = _soft(_ellipse(x, y, cx, cy, rx, ry), 1.5 * px)
    return img * (1 - heart) + (layout.tissue + 0.14) * heart, heart


def _mediastinum(img, x, y, layout: Layout, px: float) -> np.ndarray:
    """The mediastinum down the midline to the heart, and the trachea's air column in it."""
    mediastinum, trachea = _mediastinum_layers(x, y, layout, px)
    img = np.maximum(img, (layout.tissue + 0.14) * mediastinum + img * (1 - mediastinum))
    return img - 0.2 * trachea


def _mediastinum_layers(x, y, layout: Layout, px: float) -> tuple[np.ndarray, np.ndarray]:
    mediastinum = _soft(np.abs(x - 0.5) - 0.06, 2 * px) * _soft(y - layout.heart[1], 2 * px)
    trachea = _soft(np.abs(x - 0.5) - 0.016, 1.5 * px) * _soft(y - 0.3, 3 * px)
    return mediastinum, trachea


def _ribs(x, y, layout: Layout, px: float) -> np.ndarray:
    """Posterior ribs as arcs sweeping out and down from the spine, and the clavicles."""
    d = np.abs(x - 0.5)
    out = np.zeros_like(x)
    for k in range(9):
        centre = layout.rib_start + k * layout.rib_step - 0.08 * d + 0.9 * d**2
        out = np.maximum(out, _soft(np.abs(y - centre) - 0.009, 1.5 * px) * _soft(0.04 - d, 2 * px))
    clavicles = _soft(_polyline_distance(np.abs(x - 0.5), y, [(0.04, 0.13), (0.34, 0.08)]) - 0.012, 1.5 * px)
    return np.maximum(out, 1.6 * clavicles)


def _devices(x, y, layout: Layout, px: float) -> np.ndarray:
    """Radiopaque tubes, lines and a pacemaker: the brightest things on the film."""
    value = 0.9
    out = np.zeros_like(x)
    for device in layout.devices:
        out = np.maximum(out, value * _device_shape(x, y, device, px))
    return out


def _device_shape(x, y, device: str, px: float) -> np.ndarray:
    if device == "ett":
        return _soft(_polyline_distance(x, y, [(0.5, 0.0), (0.5, 0.26)]) - 0.01, px)
    if device == "line":  # right internal jugular: the image left of the neck into the SVC
        return _soft(_polyline_distance(x, y, _curve((0.36, 0.0), (0.40, 0.2), (0.46, 0.36))) - 0.008, px)
    if device == "ng":  # down the oesophagus, into the stomach under the left hemidiaphragm
        return _soft(_polyline_distance(x, y, _curve((0.49, 0.0), (0.49, 0.8), (0.66, 0.86))) - 0.008, px)
    # a pacemaker in the left chest wall, its lead curving into the heart
    box = np.maximum(np.abs(x - 0.8) - 0.055, np.abs(y - 0.2) - 0.04)
    lead = _polyline_distance(x, y, _curve((0.78, 0.2), (0.55, 0.25), (0.52, 0.62)))
    return np.maximum(_soft(box, px), _soft(lead - 0.006, px))


# ---------------------------------------------------------------- where things are drawn
#
# Boxes for the grounding tasks, from the same shape functions ``paint`` draws with,
# evaluated on a fine grid of the film: a box is the smallest one holding every grid
# pixel where the thing's own layer is at least half on (the midpoint of its soft edge).
# Coordinates are fractions of the image, (x1, y1, x2, y2), x to the image right, y down.

BOX_RESOLUTION = 400  # grid pixels per side: boxes are exact to 1/400 of the image
DEVICE_NAMES = {"ett": "endotracheal tube", "line": "central venous catheter", "pacemaker": "pacemaker",
                "ng": "nasogastric tube"}
REGIONS: tuple[str, ...] = (
    "right lung", "left lung",
    "right upper lung zone", "right mid lung zone", "right lower lung zone",
    "left upper lung zone", "left mid lung zone", "left lower lung zone",
    "cardiac silhouette", "upper mediastinum", "trachea",
)

BoxCoords = tuple[float, float, float, float]


def _box_grid(layout: Layout, n: int):
    coords = (np.arange(n, dtype=np.float32) + 0.5) / n
    x, y = np.meshgrid(coords - layout.shift[0], coords - layout.shift[1])
    return x, y, 1.0 / n


def _mask_box(mask: np.ndarray) -> BoxCoords:
    """The box of a mask's true pixels, pixel edges included, as fractions of the grid."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        raise ValueError("nothing is drawn there: an empty mask has no box")
    n_rows, n_cols = mask.shape
    return (float(cols[0] / n_cols), float(rows[0] / n_rows), float((cols[-1] + 1) / n_cols),
            float((rows[-1] + 1) / n_rows))


def finding_boxes(findings: dict[str, int], layout: Layout, *,
                  resolution: int = BOX_RESOLUTION) -> dict[str, list[BoxCoords]]:
    """Where each present finding is drawn on the film of ``layout``: name -> its boxes.

    One box per finding, except edema (diffuse: one box per lung, patient's right
    first) and support devices (one per device, in ``layout.devices`` order). Faint
    (-1) findings get the box of their faint drawing.
    """
    x, y, px = _box_grid(layout, resolution)
    lungs = {side: _lung_mask(x, y, layout, side, 1.5 * px) for side in SIDES}
    out: dict[str, list[BoxCoords]] = {}
    for name in FINDINGS:
        status = findings.get(name, 0)
        if status == 0:
            continue
        if name == "cardiomegaly":
            layers = [_heart(np.zeros_like(x), x, y, layout, status == 1, px)[1]]
        elif name.endswith("_effusion"):
            side = name.split("_")[0]
            grade = 0 if status == -1 else layout.effusion_grade[side]
            layers = [lungs[side] * _effusion(x, y, layout, side, grade, px)]
        elif name == "pneumothorax":
            layers = [_pneumothorax_layers(x, y, layout, lungs, status == -1, px)[0]]
        elif name == "nodule":
            layers = [_nodule(x, y, layout, status == -1, px) / 0.42]  # 0.42: the nodule's full brightness
        elif name == "consolidation":
            # 0.32: the patch's full brightness
            layers = [lungs[layout.consolidation_side] * _consolidation(x, y, layout, px) / 0.32]
        elif name == "edema":
            layers = [lungs["right"], lungs["left"]]
        else:
            layers = [_device_shape(x, y, device, px) for device in layout.devices]
        out[name] = [_mask_box(layer >= 0.5) for layer in layers]
    return out


def region_boxes(findings: dict[str, int], layout: Layout, *, resolution: int = BOX_RESOLUTION) -> dict[str, BoxCoords]:
    """The anatomical regions of :data:`REGIONS` on the film (the cardiac silhouette as drawn,
    enlarged with cardiomegaly); a lung's upper, mid and lower zones are the thirds of its height."""
    x, y, px = _box_grid(layout, resolution)
    out: dict[str, BoxCoords] = {}
    zones = {}
    for side in ("right", "left"):
        lung = _lung_mask(x, y, layout, side, 1.5 * px) >= 0.5
        out[f"{side} lung"] = _mask_box(lung)
        rows = np.flatnonzero(lung.any(axis=1))
        cuts = np.linspace(rows[0], rows[-1] + 1, 4).round().astype(int)
        for zone, start, stop in zip(("upper", "mid", "lower"), cuts[:-1], cuts[1:]):
            band = np.zeros_like(lung)
            band[start:stop] = lung[start:stop]
            zones[f"{side} {zone} lung zone"] = _mask_box(band)
    out.update(zones)
    out["cardiac silhouette"] = _mask_box(
        _heart(np.zeros_like(x), x, y, layout, findings.get("cardiomegaly", 0) == 1, px)[1] >= 0.5)
    mediastinum, trachea = _mediastinum_layers(x, y, layout, px)
    out["upper mediastinum"] = _mask_box(mediastinum >= 0.5)
    out["trachea"] = _mask_box(trachea >= 0.5)
    return {name: out[name] for name in REGIONS}


# ---------------------------------------------------------------- studies


def sample_findings(rng: np.random.Generator) -> dict[str, int]:
    """Independent draws from PRIORS; a present hedgeable finding is uncertain (-1) at UNCERTAIN_RATE."""
    findings = {}
    for name in FINDINGS:
        present = rng.random() < PRIORS[name]
        hedged = rng.random() < UNCERTAIN_RATE  # drawn always, so that later draws do not shift
        findings[name] = (-1 if hedged and name in HEDGEABLE else 1) if present else 0
    return findings


def render_image(findings: dict[str, int], rng: np.random.Generator, size: int = 112) -> Image.Image:
    """A film showing exactly ``findings`` (missing names count as absent).

    The same generator state gives the same anatomy and noise whatever the findings,
    so two calls that differ in one finding differ only where that finding is drawn.
    """
    layout = sample_layout(rng)
    return paint({name: findings.get(name, 0) for name in FINDINGS}, layout, rng, size)


def generate_study(index: int, *, seed: int, image_size: int = 112) -> Study:
    """Study ``index`` of ``seed``: independent of how many studies are generated."""
    root = np.random.SeedSequence([seed, index])
    findings_rng, image_rng, report_rng = (np.random.default_rng(s) for s in root.spawn(3))
    findings = sample_findings(findings_rng)
    layout = sample_layout(image_rng)
    image = paint(findings, layout, image_rng, image_size)
    report = write_report(findings, layout, report_rng)
    return Study(image=image, findings=findings, report=report, id=f"cxr-{seed}-{index:05d}", layout=layout)


def generate_studies(n: int, *, seed: int, image_size: int = 112) -> list[Study]:
    """``n`` synthetic studies, deterministic under ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [generate_study(i, seed=seed, image_size=image_size) for i in range(n)]


# ---------------------------------------------------------------- files

FORMATS = ("llava", "easyr1")


def write_dataset(
    directory: str | os.PathLike,
    n: int,
    *,
    seed: int,
    image_size: int = 112,
    format: str = "llava",
    name: str = "data",
    prompts: Sequence[str] | None = None,
    task: str = "report",
) -> Path:
    """Write ``n`` studies as PNGs under ``directory/images/`` and a data file; return its path.

    ``format="llava"``: ``{name}.json``, a list of ``{"id", "image", "conversations"}``.
    ``format="easyr1"``: ``{name}.jsonl``, one ``{"problem", "answer", "images", "id"}``
    per line. Every record also has ``findings`` (the ground-truth labels) for
    evaluation. Image paths are relative to the data file. Record ``i`` uses
    ``prompts[i % len(prompts)]`` (default: :data:`PROMPT`). Files are written
    atomically (:mod:`grouprl.files`), so a reader never sees a half-written file.

    ``task``: ``report`` (the default: report generation, as above) or one of
    RadVLM-GRPO's other tasks (``classification``, ``anatomical_grounding``,
    ``abnormality_grounding``, ``phrase_grounding``, ``conversation``), whose records
    :mod:`grouprl.domains.radiology.synthetic.tasks` writes from the same studies (ids
    ``<study id>-<task>``; phrase grounding skips studies with no finding; the
    conversation task is LLaVA only). ``prompts`` belong to the report task.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if task == "report":
        prompts = (PROMPT,) if prompts is None else prompts
        if not prompts:
            raise ValueError("prompts must name at least one prompt")
    else:
        from grouprl.domains.radiology.synthetic.tasks import TASKS, task_record

        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        if prompts is not None:
            raise ValueError(f"prompts are the report task's; the {task} task writes its own questions")
        if format == "easyr1" and task == "conversation":
            raise ValueError("the conversation task has several turns; write it with format='llava'")
    root = Path(directory)
    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        study = generate_study(i, seed=seed, image_size=image_size)
        relative = f"images/{study.id}.png"
        if task != "report":
            record = task_record(study, task, seed=seed, index=i, image=relative, format=format)
            if record is not None:
                _write_png(study.image, root / relative)
                records.append(record)
            continue
        _write_png(study.image, root / relative)
        prompt = prompts[i % len(prompts)]
        if format == "llava":
            records.append({
                "id": study.id,
                "image": relative,
                "conversations": [
                    {"from": "human", "value": "<image>\n" + prompt},
                    {"from": "gpt", "value": study.report},
                ],
                "findings": study.findings,
            })
        else:
            records.append({
                "problem": "<image>" + prompt,
                "answer": study.report,
                "images": [relative],
                "id": study.id,
                "findings": study.findings,
            })
    if format == "llava":
        path, text = root / f"{name}.json", json.dumps(records, indent=1)
    else:
        path, text = root / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records)
    write_text_atomic(path, text)
    return path


def _write_png(image: Image.Image, path: Path) -> None:
    with AtomicFile(path, "wb") as fh:
        image.save(fh, format="PNG")
