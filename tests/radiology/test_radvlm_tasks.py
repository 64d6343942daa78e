"""RadVLM-GRPO's classification, grounding and conversation tasks: parsing, scores, the judge,
the synthetic data, and `grouprl generate` / `grouprl eval --task` end to end."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from grouprl.cli import main
from grouprl.data import load_samples
from grouprl.domains.radiology.synthetic.cxr import (
    DEVICE_NAMES,
    FINDINGS,
    corpus,
    finding_boxes,
    generate_study,
    write_dataset,
)
from grouprl.domains.radiology.synthetic.tasks import ABNORMALITIES, LABELS, present
from grouprl.domains.radiology.evaluation import evaluate_file
from grouprl.rewards import RewardError, RewardSet
from grouprl.domains.radiology.findings import extract_findings
from grouprl.rewards.judge import ChatJudge, JudgeError
from grouprl.domains.radiology.rewards.classification import (
    classification_corpus_scores,
    parse_findings_list,
    set_f1,
)
from grouprl.domains.radiology.rewards.conversation import parse_overall_score
from grouprl.domains.radiology.rewards.grounding import (
    Box,
    BoxFormatError,
    box_iou,
    format_boxes,
    grounding_score,
    max_weight_matching,
    parse_boxes,
)

GROUNDING_TASKS = ("anatomical_grounding", "abnormality_grounding", "phrase_grounding")


# ----------------------------------------------------------------------------- boxes


def coords(boxes):
    return [b.coords() for b in boxes]


def test_parse_boxes_reads_every_seed_format():
    # anatomical grounding (Chest ImaGenome): one box, coordinates as Python's round() prints them
    anatomy = parse_boxes("The right lung is located at the coordinates [0.14, 0.1, 0.47, 1.0] on the image.")
    assert coords(anatomy) == [[0.14, 0.1, 0.47, 1.0]] and anatomy[0].label is None
    # phrase grounding (MS-CXR): several boxes joined with ", " and " and "
    phrase = parse_boxes("This phrase can be observed at [0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.6, 0.6] and "
                         "[0, .25, 1, 0.75] on the image.")
    assert coords(phrase) == [[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.6, 0.6], [0.0, 0.25, 1.0, 0.75]]
    assert all(b.label is None for b in phrase)
    # abnormality grounding (VinDr-CXR): labelled groups separated by ";"
    text = ("After a detailed review, we have discovered a nodule/mass located at the coordinates "
            "[0.6, 0.3, 0.67, 0.37]; an Aortic enlargement located at the coordinates [0.4, 0.2, 0.6, 0.4] and "
            "[0.41, 0.21, 0.59, 0.39]; a pleural effusion located at the coordinates [0.1, 0.6, 0.3, 0.8].")
    boxes = parse_boxes(text, strict=True)
    assert [b.label for b in boxes] == ["nodule/mass", "aortic enlargement", "aortic enlargement", "pleural effusion"]
    assert coords(boxes)[1:3] == [[0.4, 0.2, 0.6, 0.4], [0.41, 0.21, 0.59, 0.39]]
    assert parse_boxes("No abnormalities or lesions are detected on this Chest X-ray.", strict=True) == []
    # what RadVLM's format_boxes writes reads back as the same rounded boxes
    written = format_boxes([[0.123, 0.456, 0.789, 0.999], [0.1, 0.2, 0.3, 0.4]])
    assert written == "[0.12, 0.46, 0.79, 1.0] and [0.1, 0.2, 0.3, 0.4]"
    assert coords(parse_boxes(written)) == [[0.12, 0.46, 0.79, 1.0], [0.1, 0.2, 0.3, 0.4]]


def test_parse_boxes_lenient_for_outputs_strict_for_references():
    messy = "Boxes: [0.1, 0.2, 0.3] [a, b, c, d] [0.2, 0.2, 0.1, 0.1] [-0.1, 0.0, 1.2, 0.5]"
    boxes = parse_boxes(messy)
    assert coords(boxes) == [[0.2, 0.2, 0.1, 0.1], [-0.1, 0.0, 1.2, 0.5]]  # three numbers and words are no box
    assert boxes[0].area == 0.0  # corners swapped: no area, so it overlaps nothing
    for bad, message in (("at [0.1, 0.2, 0.3]", "malformed box '\\[0.1, 0.2, 0.3\\]'"),
                         ("at [0.1, 0.2, 1.3, 0.4]", "box '\\[0.1, 0.2, 1.3, 0.4\\]' has a coordinate outside"),
                         ("at [0.3, 0.2, 0.1, 0.4]", "box '\\[0.3, 0.2, 0.1, 0.4\\]' is empty")):
        with pytest.raises(BoxFormatError, match=f"record 7: {message}"):
            parse_boxes(bad, strict=True, where="record 7")


def test_iou_of_known_geometry():
    a = Box(0.0, 0.0, 0.5, 0.5)
    assert box_iou(a, a) == 1.0
    assert box_iou(a, Box(0.5, 0.5, 1.0, 1.0)) == 0.0  # touching corners
    assert box_iou(a, Box(0.25, 0.0, 0.75, 0.5)) == pytest.approx(0.125 / 0.375)
    assert box_iou(Box(0.0, 0.0, 1.0, 1.0), a) == pytest.approx(0.25)  # contained
    assert box_iou(Box(0.5, 0.5, 0.0, 0.0), a) == 0.0  # swapped corners: no area


def brute_force(weights):
    n, m = len(weights), len(weights[0])
    if n <= m:
        return max(sum(weights[i][j] for i, j in enumerate(cols)) for cols in itertools.permutations(range(m), n))
    return max(sum(weights[i][j] for j, i in enumerate(rows)) for rows in itertools.permutations(range(n), m))


def test_matching_is_the_optimal_assignment():
    # greedy (best pair first) would take 0.9 and then 0.0; the optimum pairs across: 0.8 + 0.8
    assert max_weight_matching([[0.9, 0.8], [0.8, 0.0]]) == [(0, 1), (1, 0)]
    rng = np.random.default_rng(0)
    for n, m in [(1, 1), (2, 3), (3, 2), (4, 4), (5, 3), (3, 5), (5, 5)]:
        for _ in range(15):
            w = rng.random((n, m)).round(2).tolist()
            pairs = max_weight_matching(w)
            assert len(pairs) == min(n, m)
            assert len({i for i, _ in pairs}) == len({j for _, j in pairs}) == len(pairs)
            assert sum(w[i][j] for i, j in pairs) == pytest.approx(brute_force(w))
    assert max_weight_matching([]) == [] and max_weight_matching([[], []]) == []


def test_grounding_score_penalises_unmatched_boxes_and_wrong_labels():
    ref = [Box(0.1, 0.1, 0.3, 0.3), Box(0.6, 0.6, 0.9, 0.9)]
    perfect = grounding_score(list(reversed(ref)), ref)
    assert (perfect.iou, perfect.precision, perfect.recall, perfect.f1) == (1.0, 1.0, 1.0, 1.0)
    extra = grounding_score(ref + [Box(0.4, 0.0, 0.5, 0.1)], ref)  # one predicted box too many
    assert extra.iou == pytest.approx(2 / 3) and extra.precision == pytest.approx(2 / 3) and extra.recall == 1.0
    missed = grounding_score(ref[:1], ref)  # one reference box not found
    assert missed.iou == 0.5 and missed.precision == 1.0 and missed.recall == 0.5 and missed.f1 == pytest.approx(2 / 3)
    half = grounding_score([Box(0.1, 0.1, 0.2, 0.3)], ref[:1])  # IoU 0.5: a hit at 0.5, not at 0.6
    assert half.iou == pytest.approx(0.5) and half.f1 == 1.0
    assert grounding_score([Box(0.1, 0.1, 0.2, 0.3)], ref[:1], iou_threshold=0.6).f1 == 0.0
    assert grounding_score([], []).iou == 1.0  # nothing to find and nothing claimed
    assert grounding_score([], ref).iou == 0.0 and grounding_score(ref, []).iou == 0.0
    named = [Box(0.1, 0.1, 0.3, 0.3, "nodule")]
    wrong_name = [Box(0.1, 0.1, 0.3, 0.3, "effusion")]
    assert grounding_score(wrong_name, named).iou == 0.0
    assert grounding_score(wrong_name, named, labels="ignore").iou == 1.0
    assert grounding_score([Box(0.1, 0.1, 0.3, 0.3)], named).iou == 1.0  # unlabelled output: labels not compared


# ----------------------------------------------------------------------------- classification


def test_findings_list_parsing_and_set_f1():
    assert parse_findings_list("The following abnormalities are present: Cardiomegaly, pleural effusion and "
                               "edema.") == {"cardiomegaly", "pleural effusion", "edema"}
    assert parse_findings_list("Yes, there is one abnormality identified: pneumothorax.") == {"pneumothorax"}
    assert parse_findings_list("Findings: a nodule, an effusion, and the edema") == {"nodule", "effusion", "edema"}
    for none in ("No abnormalities or lesions are detected on this Chest X-ray.",
                 "There are no findings on this Chest X-ray.", "The Chest X-ray appears to be clear of any findings.",
                 "The following abnormalities are present: No Finding."):
        assert parse_findings_list(none) == frozenset(), none
    assert parse_findings_list("Cardiomegaly.") == {"cardiomegaly"}  # no colon, no negation: the answer is the list
    assert set_f1({"a", "b"}, {"a", "b"}) == 1.0
    assert set_f1({"a", "b", "c"}, {"a"}) == pytest.approx(0.5)  # 2*1 / (3+1)
    assert set_f1(set(), set()) == 1.0 and set_f1({"a"}, set()) == 0.0 and set_f1(set(), {"a"}) == 0.0


def test_classification_corpus_scores_by_hand():
    preds = [{"a", "b"}, {"a"}, set()]
    refs = [{"a"}, {"a", "c"}, set()]
    scores = classification_corpus_scores(preds, refs)
    # TP: a, a -> 2; FP: b -> 1; FN: c -> 1
    assert scores["micro_precision"] == pytest.approx(2 / 3) and scores["micro_recall"] == pytest.approx(2 / 3)
    assert scores["micro_f1"] == pytest.approx(4 / 6)
    assert scores["macro_f1"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)  # a: 4/4, b: 0, c: 0
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert classification_corpus_scores([set()], [set()])["micro_f1"] is None  # undefined, not 0 or 1


# ----------------------------------------------------------------------------- rewards by name


def test_task_rewards_are_registered_plugin_names():
    code = textwrap.dedent("""
        import json, sys
        from grouprl.rewards import get_reward
        fns = {n: get_reward(n).__module__ for n in ("grounding_iou", "classification_set_f1", "conversation_judge")}
        print(json.dumps(fns))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert modules == {"grounding_iou": "grouprl.domains.radiology.rewards.grounding",
                       "classification_set_f1": "grouprl.domains.radiology.rewards.classification",
                       "conversation_judge": "grouprl.domains.radiology.rewards.conversation"}


def test_task_rewards_score_their_rows_and_name_bad_references():
    rewards = RewardSet.from_specs(["grounding_iou", "classification_set_f1"])
    answers = [("I can find a nodule located at the coordinates [0.1, 0.1, 0.3, 0.3]; an edema located at the "
                "coordinates [0.5, 0.5, 0.9, 0.9]."),
               "The following abnormalities are present: nodule and edema."]
    completions = ["I can find a nodule located at the coordinates [0.1, 0.1, 0.3, 0.3].", "One abnormality: edema."]
    result = rewards.score(["q", "q"], completions, {"answer": answers, "task": ["abnormality_grounding",
                                                                                  "classification"],
                                                     "id": ["g1", "c1"]})
    assert result.components["grounding_iou"] == [pytest.approx(0.5), None]  # the edema box is missed
    assert result.components["classification_set_f1"] == [None, pytest.approx(2 / 3)]
    f1 = RewardSet.from_specs([{"name": "grounding_iou", "kwargs": {"score": "f1"}}])
    assert f1.score(["q"], completions[:1], {"answer": answers[:1]}).total == [pytest.approx(2 / 3)]
    with pytest.raises(RewardError, match=r"grounding_iou.*row 1 \(id 'g2'\), reference answer: malformed box"):
        rewards.score(["q", "q"], ["[0.1, 0.1, 0.2, 0.2]"] * 2,
                      {"answer": ["[0.1, 0.1, 0.2, 0.2]", "at [0.1, 0.1, 0.2]"], "id": ["g1", "g2"],
                       "task": ["phrase_grounding", "phrase_grounding"]})


# ----------------------------------------------------------------------------- the judge


class FakeJudge:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1.

    It answers 9/10 when the assistant's answer equals the expected one, else 3/10; ``script``
    holds (status, content or body, delay) answers used first, one per request.
    """

    def __init__(self, key: str = "judge-key"):
        self.key, self.script, self.requests, self.lock = key, [], [], threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                          "body": body})
                    scripted = fake.script.pop(0) if fake.script else None
                if self.path != "/v1/chat/completions":
                    return self._send(404, '{"error": "not found"}')
                if self.headers.get("Authorization") != f"Bearer {fake.key}":
                    return self._send(401, '{"error": "bad key"}')
                if scripted is not None:
                    status, content, delay = scripted
                    time.sleep(delay)
                    if status != 200:
                        return self._send(status, content)
                else:
                    text = body["messages"][0]["content"]
                    expected = text.split("Expected answer: ", 1)[1].split("\n\nAssistant's answer: ")[0]
                    given = text.split("Assistant's answer: ", 1)[1]
                    content = ("The answer matches.\nOverall score: 9/10" if given == expected
                               else "It misses the finding.\nOverall score: 3/10")
                self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}))

            def _send(self, status, text):
                data = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    if status != 200:
                        self.send_header("retry-after-ms", "1")  # a retry may follow at once: fast tests
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def fake_judge(monkeypatch):
    judge = FakeJudge()
    monkeypatch.setenv("TEST_JUDGE_KEY", "judge-key")
    yield judge
    judge.close()


HISTORY = [{"from": "human", "value": "<image>\nWhat do you see?"}, {"from": "gpt", "value": "I can see edema."},
           {"from": "human", "value": "Is the heart enlarged?"}]


def test_overall_score_parsing():
    assert parse_overall_score("Reasoning...\nOverall score: 7/10") == 7.0
    assert parse_overall_score("overall score: **8.5** / 10\nOverall Score: 6/10") == 6.0  # the last line counts
    for bad in ("Score: 7", "Overall score: 11/10", ""):
        with pytest.raises(ValueError):
            parse_overall_score(bad)


def test_judge_scores_retries_and_sends_the_key(fake_judge):
    fake_judge.script = [(503, "overloaded", 0.0), (200, "I cannot grade this.", 0.0)]  # transient, then unusable
    with ChatJudge(fake_judge.base_url, "judge-model", api_key_env="TEST_JUDGE_KEY", backoff=0.0) as judge:
        value, reply = judge.judge([{"role": "user", "content": "Expected answer: a\n\nAssistant's answer: a"}],
                                   parse_overall_score)
    assert value == 9.0 and reply.endswith("9/10")
    assert len(fake_judge.requests) == 3  # 503 and the unusable reply were retried
    assert {r["auth"] for r in fake_judge.requests} == {"Bearer judge-key"}
    assert fake_judge.requests[0]["body"]["model"] == "judge-model"


def test_judge_failures_are_errors_or_unscored_never_zero(fake_judge, monkeypatch):
    msg = [{"role": "user", "content": "Expected answer: a\n\nAssistant's answer: b"}]
    # one request at a time, so that the scripted answers go to the first item's attempts
    judge = ChatJudge(fake_judge.base_url, "m", api_key_env="TEST_JUDGE_KEY", backoff=0.0, max_retries=1,
                      concurrency=1)
    fake_judge.script = [(500, "down", 0.0), (500, "still down", 0.0)]
    with pytest.raises(JudgeError, match=r"failed for item 0 after 2 attempt\(s\) \(last status 500\)"):
        judge.judge_many([msg], parse_overall_score)
    fake_judge.script = [(200, "no score here", 0.0), (200, "nor here", 0.0)]
    outcomes = judge.judge_many([msg, msg], parse_overall_score, items=["id 'x'", "id 'y'"], on_failure="skip")
    assert outcomes[0].value is None and "unusable reply" in outcomes[0].error and "id 'x'" in outcomes[0].error
    assert outcomes[1].value == 3.0
    judge.close()
    monkeypatch.setenv("TEST_JUDGE_KEY", "wrong")  # refused: no retry can help, so no retry is made
    with ChatJudge(fake_judge.base_url, "m", api_key_env="TEST_JUDGE_KEY", backoff=0.0) as refused:
        before = len(fake_judge.requests)
        with pytest.raises(JudgeError, match="refused item 0: HTTP 401") as info:
            refused.judge_many([msg], parse_overall_score)
        assert info.value.attempts == 1 and len(fake_judge.requests) == before + 1
    monkeypatch.setenv("TEST_JUDGE_KEY", "judge-key")
    fake_judge.script = [(200, "Overall score: 9/10", 1.0)]  # answers after the client's timeout
    with ChatJudge(fake_judge.base_url, "m", api_key_env="TEST_JUDGE_KEY", timeout=0.2, max_retries=0) as slow:
        with pytest.raises(JudgeError, match="timed out after 0.2 s"):
            slow.judge(msg, parse_overall_score)


def test_conversation_reward_through_the_reward_set(fake_judge):
    options = {"base_url": fake_judge.base_url, "model": "m", "api_key_env": "TEST_JUDGE_KEY", "backoff": 0.0,
               "max_retries": 0}
    rewards = RewardSet.from_specs([{"name": "conversation_judge", "kwargs": options}])
    columns = {"answer": ["No, the heart size appears normal.", "Yes.", "x"], "history": [HISTORY, HISTORY, None],
               "task": ["conversation", "conversation", "classification"], "id": ["a", "b", "c"]}
    result = rewards.score(["p"] * 3, ["No, the heart size appears normal.", "No.", "x"], columns, allow_unscored=True)
    assert result.components["conversation_judge"] == [pytest.approx(0.9), pytest.approx(0.3), None]
    sent = fake_judge.requests[0]["body"]["messages"][0]["content"]
    assert "User: What do you see?\nAssistant: I can see edema.\nUser: Is the heart enlarged?" in sent
    fake_judge.script = [(200, "no verdict", 0.0)]
    with pytest.raises(RewardError, match=r"conversation_judge.*row 0 \(id 'a'\)"):
        rewards.score(["p"], ["No."], {k: v[:1] for k, v in columns.items()})
    skip = RewardSet.from_specs([{"name": "conversation_judge", "kwargs": {**options, "on_failure": "skip"}}])
    fake_judge.script = [(200, "no verdict", 0.0)]
    skipped = skip.score(["p"], ["No."], {k: v[:1] for k, v in columns.items()}, allow_unscored=True)
    assert skipped.components["conversation_judge"] == [None] and skipped.total == [None]  # unscored, not 0


# ----------------------------------------------------------------------------- synthetic data


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    paths = {task: write_dataset(root, 12, seed=5, task=task, name=task)
             for task in ("classification", *GROUNDING_TASKS, "conversation")}
    return root, paths


def test_generator_writes_each_task_as_llava_records(task_data):
    root, paths = task_data
    assert set(LABELS) == set(FINDINGS)
    sentences = set(corpus())
    studies = {f"cxr-5-{i:05d}": generate_study(i, seed=5) for i in range(12)}
    for task, path in paths.items():
        records = json.loads(path.read_text())
        samples = load_samples(path)  # the loader reads every task's records
        assert len(samples) == len(records) > 0
        for record, sample in zip(records, samples):
            study = studies[record["id"][: -len(task) - 1]]
            assert record["id"] == f"{study.id}-{task}" and record["task"] == task
            assert record["findings"] == study.findings and (root / record["image"]).is_file()
            assert sample.answer == record["conversations"][-1]["value"]
            if task == "classification":
                assert record["labels"] == [LABELS[n] for n in present(study)]
                assert parse_findings_list(sample.answer) == set(record["labels"])
            elif task in GROUNDING_TASKS:
                boxes = parse_boxes(sample.answer, strict=True, where=record["id"])  # in [0, 1], non-empty
                assert coords(boxes) == [b["box"] for b in record["boxes"]]
                if task == "abnormality_grounding":
                    assert [b.label for b in boxes] == [b["label"] for b in record["boxes"]]
                    assert {b["label"] for b in record["boxes"]} == {LABELS[n] for n in present(study, ABNORMALITIES)}
                if task == "phrase_grounding":  # a real report sentence about the boxed finding
                    assert record["phrase"] in sentences and record["phrase"] in sample.messages[0]["content"][1]["text"]
                    label = record["boxes"][0]["label"]
                    drawn = finding_boxes(study.findings, study.layout)
                    if label in DEVICE_NAMES.values():
                        k = [DEVICE_NAMES[d] for d in study.layout.devices].index(label)
                        expected = [drawn["support_device"][k]]
                        assert extract_findings(record["phrase"])["support_device"] == 1
                    else:
                        name = next(n for n, lab in LABELS.items() if lab == label)
                        expected = drawn[name]
                        assert extract_findings(record["phrase"])[name] == study.findings[name]
                    assert coords(boxes) == [[round(v, 2) for v in b] for b in expected]
            else:
                turns = record["conversations"]
                assert 6 <= len(turns) <= 8 and [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
                assert sample.messages[-1]["role"] == "user" and len(sample.messages) == len(turns) - 1
    phrase = json.loads(paths["phrase_grounding"].read_text())
    assert len(phrase) == sum(any(v != 0 for v in s.findings.values()) for s in studies.values())


def test_phrase_grounding_boxes_the_device_its_phrase_names():
    import dataclasses

    from grouprl.domains.radiology.synthetic.cxr import DEVICE
    from grouprl.domains.radiology.synthetic.tasks import task_record

    base = generate_study(0, seed=1)
    layout = dataclasses.replace(base.layout, devices=("line", "pacemaker"))
    study = dataclasses.replace(base, findings={n: int(n == "support_device") for n in FINDINGS}, layout=layout)
    boxes = finding_boxes(study.findings, layout)["support_device"]
    seen = set()
    for index in range(12):
        record = task_record(study, "phrase_grounding", seed=1, index=index, image="x.png")
        (box,) = record["boxes"]
        k = [DEVICE_NAMES[d] for d in layout.devices].index(box["label"])
        assert record["phrase"] in DEVICE[layout.devices[k]]  # the sentence is about that device
        assert box["box"] == [round(v, 2) for v in boxes[k]]
        seen.add(k)
    assert seen == {0, 1}


def test_conversation_answers_follow_the_findings(task_data):
    _, paths = task_data
    for record in json.loads(paths["conversation"].read_text()):
        findings = record["findings"]
        turns = record["conversations"]
        for question, answer in zip(turns[::2], turns[1::2]):
            q, a = question["value"], answer["value"]
            if q == "Is the heart enlarged?":
                assert a.startswith("Yes") == (findings["cardiomegaly"] == 1), (q, a)
            elif q == "Is there a collapsed lung?":
                assert a.startswith("No") == (findings["pneumothorax"] == 0), (q, a)
            elif q == "Are there any tubes or lines?":
                assert a.startswith("Yes") == (findings["support_device"] == 1), (q, a)
            elif q.startswith("Where is the"):
                label = q[len("Where is the "):-len(" located on the image?")]
                name = next(n for n, lab in LABELS.items() if lab == label)
                study = generate_study(int(record["id"].split("-")[2]), seed=5)
                expected = [[round(v, 2) for v in b] for b in finding_boxes(study.findings, study.layout)[name]]
                assert coords(parse_boxes(a, strict=True)) == expected


def test_generator_task_errors(tmp_path):
    with pytest.raises(ValueError, match="task must be one of"):
        write_dataset(tmp_path, 1, seed=0, task="segmentation")
    with pytest.raises(ValueError, match="prompts are the report task's"):
        write_dataset(tmp_path, 1, seed=0, task="classification", prompts=["Q?"])
    with pytest.raises(ValueError, match="conversation task has several turns"):
        write_dataset(tmp_path, 1, seed=0, task="conversation", format="easyr1")
    single = write_dataset(tmp_path, 3, seed=0, task="classification", format="easyr1", name="c")
    rows = [json.loads(line) for line in single.read_text().splitlines()]
    assert all(r["problem"].startswith("<image>") and r["task"] == "classification" for r in rows)


# ----------------------------------------------------------------------------- grouprl eval --task


def predictions_from(path, transform):
    """{id, response, answer} records answering each record with transform(answer, index)."""
    records = json.loads(path.read_text())
    return [{"id": r["id"], "response": transform(r["conversations"][-1]["value"], i),
             "answer": r["conversations"][-1]["value"]} for i, r in enumerate(records)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_cli_eval_grounding_and_classification(task_data, tmp_path, capsys):
    _, paths = task_data

    def drop_last_box(answer, i):  # every other record misses a box (or says nothing at all)
        boxes = parse_boxes(answer)
        return answer if i % 2 == 0 or not boxes else format_boxes([b.coords() for b in boxes[:-1]] or [[0, 0, .01, .01]])

    preds = predictions_from(paths["abnormality_grounding"], drop_last_box)
    data = write_jsonl(tmp_path / "g.jsonl", preds)
    assert main(["eval", "--task", "grounding", "--data", str(data), "--out", str(tmp_path / "g"),
                 "--bootstrap", "200", "--corpus-bootstrap", "20"]) == 0
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    metrics = {m["metric"]: m for m in summary["metrics"]}
    expected = [grounding_score(parse_boxes(p["response"]), parse_boxes(p["answer"])) for p in preds]
    assert metrics["iou"]["value"] == pytest.approx(np.mean([s.iou for s in expected]))
    assert metrics["iou"]["ci_low"] <= metrics["iou"]["value"] <= metrics["iou"]["ci_high"]
    assert metrics["f1@0.5"]["value"] == pytest.approx(np.mean([s.f1 for s in expected]))
    assert 0 < metrics["grounding/micro_recall@0.5"]["value"] < 1 and metrics["grounding/micro_recall@0.5"]["kind"] == "corpus"
    assert metrics["grounding/micro_recall@0.5"]["ci_low"] is not None
    assert summary["task"] == "grounding" and summary["options"]["iou_threshold"] == 0.5
    rows = read_csv(tmp_path / "g" / "per_sample.csv")
    assert rows[0][0] == "id" and rows[0][1].startswith("iou[") and len(rows) == len(preds) + 1
    assert "iou" in capsys.readouterr().out

    preds = predictions_from(paths["classification"], lambda a, i: a if i % 3 else "No abnormalities are seen.")
    data = write_jsonl(tmp_path / "c.jsonl", preds)
    assert main(["eval", "--task", "classification", "--data", str(data), "--out", str(tmp_path / "c"),
                 "--bootstrap", "100"]) == 0
    metrics = {m["metric"]: m for m in json.loads((tmp_path / "c" / "summary.json").read_text())["metrics"]}
    refs = [parse_findings_list(p["answer"]) for p in preds]
    hyps = [parse_findings_list(p["response"]) for p in preds]
    assert metrics["set_f1"]["value"] == pytest.approx(np.mean([set_f1(h, r) for h, r in zip(hyps, refs)]))
    assert metrics["classification/micro_f1"]["value"] == pytest.approx(
        classification_corpus_scores(hyps, refs)["micro_f1"])


def test_cli_eval_names_bad_task_records(task_data, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "ok", "response": "[0, 0, 1, 1]", "answer": "at [0, 0, 1, 1]"},
                                               {"id": "s-7", "response": "x", "answer": "at [0.5, 0.1, 0.2, 0.3]"}])
    assert main(["eval", "--task", "grounding", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "record 1 (id 's-7'): field 'answer': box '[0.5, 0.1, 0.2, 0.3]' is empty" in capsys.readouterr().err
    conv = write_jsonl(tmp_path / "conv.jsonl", [{"id": "c-1", "response": "x", "answer": "y"}])
    assert main(["eval", "--task", "conversation", "--data", str(conv), "--out", str(tmp_path / "o2"),
                 "--judge-base-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]) == 2
    assert "record 0 (id 'c-1'): field 'history' is missing" in capsys.readouterr().err
    assert main(["eval", "--task", "conversation", "--data", str(conv), "--out", str(tmp_path / "o3")]) == 2
    assert "the judge needs base_url and model" in capsys.readouterr().err


def test_cli_eval_conversation_with_a_judge(fake_judge, tmp_path, capsys):
    records = [{"id": "a", "response": "No.", "answer": "No.", "history": HISTORY},
               {"id": "b", "response": "Yes.", "answer": "No.", "history": HISTORY},
               {"id": "c", "response": "No.", "answer": "No.", "history": HISTORY}]
    data = write_jsonl(tmp_path / "conv.jsonl", records)
    args = ["eval", "--task", "conversation", "--data", str(data), "--judge-base-url", fake_judge.base_url,
            "--judge-model", "m", "--judge-api-key-env", "TEST_JUDGE_KEY", "--judge-retries", "0",
            "--judge-concurrency", "1", "--bootstrap", "50"]
    assert main([*args, "--out", str(tmp_path / "ok")]) == 0
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["metrics"][0]["metric"] == "judge_score"
    assert summary["metrics"][0]["value"] == pytest.approx((0.9 + 0.3 + 0.9) / 3)
    assert summary["options"]["judge"] == f"judge=m at {fake_judge.base_url}/chat/completions"
    fake_judge.script = [(200, "Overall score: 9/10", 0.0), (200, "I refuse to grade.", 0.0)]
    assert main([*args, "--out", str(tmp_path / "fail")]) == 1  # the judge failed: no summary with a made-up score
    assert "failed for record 1 (id 'b')" in capsys.readouterr().err
    assert not (tmp_path / "fail" / "summary.json").exists()
    fake_judge.script = [(200, "Overall score: 9/10", 0.0), (200, "I refuse to grade.", 0.0)]
    assert main([*args, "--out", str(tmp_path / "skip"), "--judge-on-failure", "skip"]) == 0
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["n_unscored"] == 1 and summary["unscored"][0]["id"] == "b"
    assert summary["metrics"][0]["value"] == pytest.approx(0.9)  # the mean of the scored records only
    assert [row[1] for row in read_csv(tmp_path / "skip" / "per_sample.csv")[1:]] == ["0.9", "", "0.9"]


# ----------------------------------------------------------------------------- generate -> eval


def test_generate_then_eval_each_task_with_a_tiny_vlm(task_data, fake_judge, tmp_path):
    from grouprl.models.tiny import build_tiny_vlm

    _, paths = task_data
    texts = [t["value"] for task in ("classification", "abnormality_grounding", "conversation")
             for r in json.loads(paths[task].read_text()) for t in r["conversations"]]
    model = build_tiny_vlm(tmp_path / "vlm", texts, seed=0)
    for task, eval_task in (("classification", "classification"), ("abnormality_grounding", "grounding"),
                            ("conversation", "conversation")):
        out = tmp_path / f"{task}.jsonl"
        assert main(["generate", "--model", str(model), "--data", str(paths[task]), "--out", str(out),
                     "--task", eval_task, "--max-samples", "3", "--max-new-tokens", "6", "--batch-size", "3",
                     "--no-progress", "--device", "cpu"]) == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        records = json.loads(paths[task].read_text())[:3]
        assert [r["id"] for r in lines] == [r["id"] for r in records]
        assert [r["answer"] for r in lines] == [r["conversations"][-1]["value"] for r in records]
        if eval_task == "conversation":
            assert [r["history"] for r in lines] == [r["conversations"][:-1] for r in records]
        else:
            assert all(set(r) == {"id", "response", "answer"} for r in lines)
        judge = ["--judge-base-url", fake_judge.base_url, "--judge-model", "m", "--judge-api-key-env",
                 "TEST_JUDGE_KEY"] if eval_task == "conversation" else []
        assert main(["eval", "--task", eval_task, "--data", str(out), "--out", str(tmp_path / f"eval-{task}"),
                     "--bootstrap", "20", *judge]) == 0
        summary = json.loads((tmp_path / f"eval-{task}" / "summary.json").read_text())
        assert summary["n_samples"] == 3 and all(m["value"] is None or 0 <= m["value"] <= 1
                                                 for m in summary["metrics"])


def test_report_stays_the_default_task():
    from grouprl.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["eval", "--data", "p", "--out", "o"]).task == "report"
    assert parser.parse_args(["generate", "--model", "m", "--data", "d", "--out", "o"]).task == "report"
    assert evaluate_file.__kwdefaults__["task"] == "report"
