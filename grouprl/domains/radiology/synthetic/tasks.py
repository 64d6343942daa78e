"""RadVLM-GRPO's other tasks on the synthetic chest X-ray studies, as LLaVA records.

RadVLM's instruction data holds, besides report generation, abnormality
classification, anatomical / abnormality / phrase grounding and multi-turn
conversations, all as LLaVA records (``{"id", "image", "conversations"}``). The
synthetic studies of :mod:`grouprl.domains.radiology.synthetic.cxr` know their ground truth
exactly (the generator drew the findings), so each task's answer is written from it:

- ``classification``: the present findings as a list (``The following abnormalities
  are present: cardiomegaly and nodule.``), or a statement that there are none;
- ``anatomical_grounding``: one region of :data:`~grouprl.domains.radiology.synthetic.cxr.REGIONS`
  and its box, from the drawing geometry;
- ``abnormality_grounding``: every present abnormality with its boxes, in RadVLM's
  labelled form (``a nodule located at the coordinates [..]; ...``);
- ``phrase_grounding``: a report sentence about one present finding and its boxes
  (studies with nothing present give no record);
- ``conversation``: three or four question/answer rounds about the findings; the
  last answer is the reference.

Boxes are ``[x1, y1, x2, y2]`` fractions of the image, rounded to two decimals, in
the text format RadVLM uses (:func:`grouprl.domains.radiology.rewards.grounding.format_boxes`);
every record also has ``task``, the study's ``findings``, and for the grounding tasks
``boxes`` (``{"label", "box"}`` each, the same boxes as the answer text) and for
classification ``labels`` (the listed findings). The wording is varied but drawn
deterministically from ``(seed, study index, task)``, independent of the report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grouprl.domains.radiology.synthetic.cxr import (
    DEVICE_NAMES,
    FINDINGS,
    REGIONS,
    Study,
    finding_boxes,
    finding_sentence,
    region_boxes,
)
from grouprl.domains.radiology.rewards.classification import format_findings_list
from grouprl.domains.radiology.rewards.grounding import format_boxes

TASKS: tuple[str, ...] = ("report", "classification", "anatomical_grounding", "abnormality_grounding",
                          "phrase_grounding", "conversation")
# What `grouprl eval --task` calls each generator task.
EVAL_TASK = {"report": "report", "classification": "classification", "anatomical_grounding": "grounding",
             "abnormality_grounding": "grounding", "phrase_grounding": "grounding", "conversation": "conversation"}

# Finding names as the answers write them.
LABELS: dict[str, str] = {
    "cardiomegaly": "cardiomegaly",
    "left_effusion": "left pleural effusion",
    "right_effusion": "right pleural effusion",
    "pneumothorax": "pneumothorax",
    "nodule": "nodule",
    "consolidation": "consolidation",
    "edema": "edema",
    "support_device": "support devices",
}
# Abnormality grounding is about lesions (as VinDr-CXR's boxes are): devices are not among them.
ABNORMALITIES = tuple(name for name in FINDINGS if name != "support_device")

CLASSIFICATION_QUESTIONS = (
    "Which abnormalities are present on this chest X-ray?",
    "List the abnormalities you can identify on this image.",
    "Are there any abnormalities on this chest X-ray?",
)
CLASSIFICATION_MANY = ("The following abnormalities are present: {items}.", "The image shows these abnormalities: {items}.")
CLASSIFICATION_ONE = ("One abnormality is present: {items}.", "The image shows one abnormality: {items}.")
CLASSIFICATION_NONE = ("No abnormalities are seen on this chest X-ray.", "This chest X-ray shows no abnormality.")

ANATOMY_QUESTIONS = (
    "Where is the {region} on this chest X-ray?",
    "Locate the {region} on this image.",
    "Show the position of the {region} on this radiograph.",
)
ANATOMY_ANSWERS = ("The {region} is located at the coordinates {boxes} on the image.", "The {region} is at {boxes}.")

ABNORMALITY_QUESTIONS = (
    "Are there abnormalities on this chest X-ray, and where are they?",
    "Find the abnormalities on this image and give their locations.",
)
ABNORMALITY_PREFIXES = ("I can find", "The image shows", "There is")
ABNORMALITY_NONE = ("No abnormalities are found on this chest X-ray.", "I find no abnormality on this image.")

PHRASE_QUESTIONS = (
    "Locate this finding on the image: {phrase}",
    "Where on the chest X-ray is the following seen? {phrase}",
    "Show where this is visible: {phrase}",
)
PHRASE_ANSWERS = ("It is seen at {boxes} on the image.", "The finding is at {boxes}.")

OPENING_QUESTIONS = ("What do you see on this chest X-ray?", "Can you describe what this chest X-ray shows?")


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _rounded(box: tuple[float, ...]) -> list[float]:
    return [round(float(v), 2) for v in box]


def task_rng(seed: int, index: int, task: str) -> np.random.Generator:
    """The wording generator of study ``index`` of ``seed`` for ``task``: apart from the study's own streams."""
    return np.random.default_rng(np.random.SeedSequence([seed, index, 1 + TASKS.index(task)]))


def present(study: Study, names: tuple[str, ...] = FINDINGS) -> list[str]:
    """The findings of ``names`` present on the film (1, or -1 drawn faint), in FINDINGS order."""
    return [name for name in names if study.findings[name] != 0]


def classification_turns(study: Study, rng: np.random.Generator) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    labels = [LABELS[name] for name in present(study)]
    if not labels:
        answer = _pick(rng, CLASSIFICATION_NONE)
    else:
        answer = _pick(rng, CLASSIFICATION_MANY if len(labels) > 1 else CLASSIFICATION_ONE).format(
            items=format_findings_list(labels))
    return [(_pick(rng, CLASSIFICATION_QUESTIONS), answer)], {"labels": labels}


def anatomical_grounding_turns(study: Study, rng: np.random.Generator) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    region = _pick(rng, REGIONS)
    box = _rounded(region_boxes(study.findings, study.layout)[region])
    question = _pick(rng, ANATOMY_QUESTIONS).format(region=region)
    answer = _pick(rng, ANATOMY_ANSWERS).format(region=region, boxes=format_boxes([box]))
    return [(question, answer)], {"boxes": [{"label": region, "box": box}]}


def abnormality_grounding_turns(study: Study,
                                rng: np.random.Generator) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    names = present(study, ABNORMALITIES)
    question = _pick(rng, ABNORMALITY_QUESTIONS)
    if not names:
        return [(question, _pick(rng, ABNORMALITY_NONE))], {"boxes": []}
    boxes = finding_boxes(study.findings, study.layout)
    groups, listed = [], []
    for name in names:
        label, rounded = LABELS[name], [_rounded(b) for b in boxes[name]]
        groups.append(f"{_article(label)} {label} located at the coordinates {format_boxes(rounded)}")
        listed += [{"label": label, "box": b} for b in rounded]
    return [(question, f"{_pick(rng, ABNORMALITY_PREFIXES)} {'; '.join(groups)}.")], {"boxes": listed}


def phrase_grounding_turns(study: Study,
                           rng: np.random.Generator) -> tuple[list[tuple[str, str]], dict[str, Any]] | None:
    names = present(study)
    if not names:
        return None
    name = _pick(rng, names)
    boxes = finding_boxes(study.findings, study.layout)[name]
    if name == "support_device":  # one sentence, one device
        k = int(rng.integers(len(study.layout.devices)))
        device = study.layout.devices[k]
        phrase = finding_sentence(name, 1, study.layout, rng, device=device)
        label, boxes = DEVICE_NAMES[device], [boxes[k]]
    else:
        phrase, label = finding_sentence(name, study.findings[name], study.layout, rng), LABELS[name]
    rounded = [_rounded(b) for b in boxes]
    question = _pick(rng, PHRASE_QUESTIONS).format(phrase=phrase)
    answer = _pick(rng, PHRASE_ANSWERS).format(boxes=format_boxes(rounded))
    return [(question, answer)], {"phrase": phrase, "boxes": [{"label": label, "box": b} for b in rounded]}


def conversation_turns(study: Study, rng: np.random.Generator) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """An opening question about the whole film, then two or three follow-ups from the findings."""
    f, layout = study.findings, study.layout
    hedged = [("possible " if f[n] == -1 else "") + LABELS[n] for n in present(study)]
    opening = (f"I can see {format_findings_list(hedged)}." if hedged
               else "The chest X-ray looks normal; I see no abnormality.")
    size = {side: ("small", "moderate", "large")[layout.effusion_grade[side]] for side in ("left", "right")}
    effusion_sides = [s for s in ("left", "right") if f[f"{s}_effusion"] != 0]
    if len(effusion_sides) == 2:
        effusion = "Yes, there appear to be pleural effusions on both sides."
    elif effusion_sides and f[f"{effusion_sides[0]}_effusion"] == -1:
        effusion = f"There may be a small {effusion_sides[0]} pleural effusion, but it is not certain."
    elif effusion_sides:
        side = effusion_sides[0]
        effusion = f"Yes, there appears to be a {size[side]} {side} pleural effusion."
    else:
        effusion = "No, I see no pleural effusion."
    side = layout.pneumothorax_side
    pneumothorax = {1: f"Yes, there appears to be a {side} pneumothorax.",
                    -1: f"A small {side} pneumothorax cannot be excluded.",
                    0: "No, I see no sign of a pneumothorax."}[f["pneumothorax"]]
    lung = [("possible " if f[n] == -1 else "") + LABELS[n] for n in ("nodule", "consolidation", "edema") if f[n]]
    lungs = f"No, I can see {format_findings_list(lung)}." if lung else "Yes, the lungs look clear."
    devices = [DEVICE_NAMES[d] for d in layout.devices] if f["support_device"] else []
    tubes = (f"Yes, I can see {' and '.join(_article(d) + ' ' + d for d in devices)}." if devices
             else "No, I see no tubes or lines.")
    pool = [
        ("Is the heart enlarged?", "Yes, the heart appears enlarged." if f["cardiomegaly"]
         else "No, the heart size appears normal."),
        ("Is there fluid around the lungs?", effusion),
        ("Is there a collapsed lung?", pneumothorax),
        ("Are the lungs clear?", lungs),
        ("Are there any tubes or lines?", tubes),
    ]
    located = present(study, ABNORMALITIES)
    if located:
        name = _pick(rng, located)
        boxes = [_rounded(b) for b in finding_boxes(f, layout)[name]]
        pool.append((f"Where is the {LABELS[name]} located on the image?",
                     f"It is located at the coordinates {format_boxes(boxes)}."))
    follow = [pool[i] for i in rng.permutation(len(pool))[: 2 + int(rng.integers(2))]]
    return [(_pick(rng, OPENING_QUESTIONS), opening), *follow], {}


_BUILDERS = {
    "classification": classification_turns,
    "anatomical_grounding": anatomical_grounding_turns,
    "abnormality_grounding": abnormality_grounding_turns,
    "phrase_grounding": phrase_grounding_turns,
    "conversation": conversation_turns,
}


def task_record(study: Study, task: str, *, seed: int, index: int, image: str, format: str = "llava") -> \
        dict[str, Any] | None:
    """The record of ``task`` for a study whose image is at ``image`` (relative to the data file).

    None when the task has nothing to ask of this study (phrase grounding of a film
    with no finding). ``format``: ``llava`` (every task) or ``easyr1`` (single-turn tasks).
    """
    if task not in _BUILDERS:
        raise ValueError(f"task must be one of {', '.join(_BUILDERS)} (report records come from write_dataset), "
                         f"got {task!r}")
    if format == "easyr1" and task == "conversation":
        raise ValueError("the conversation task has several turns; write it in the llava format")
    built = _BUILDERS[task](study, task_rng(seed, index, task))
    if built is None:
        return None
    turns, extra = built
    record_id = f"{study.id}-{task}"
    if format == "llava":
        conversations = []
        for k, (question, answer) in enumerate(turns):
            conversations.append({"from": "human", "value": ("<image>\n" if k == 0 else "") + question})
            conversations.append({"from": "gpt", "value": answer})
        return {"id": record_id, "image": image, "conversations": conversations, "task": task,
                "findings": study.findings, **extra}
    (question, answer), = turns
    return {"problem": "<image>" + question, "answer": answer, "images": [image], "id": record_id, "task": task,
            "findings": study.findings, **extra}
