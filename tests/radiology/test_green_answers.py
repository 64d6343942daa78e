"""GREEN (reply parsing, a fake OpenAI-compatible judge on 127.0.0.1, retries and failures),
EditGRPO response types, CheXPO answer set F1 and evaluation text cleaning."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grouprl.domains.radiology.rewards import answers
from grouprl.domains.radiology.rewards.components import get_component
from grouprl.domains.radiology.rewards.green import (
    GreenCounts,
    GreenError,
    GreenJudge,
    GreenParseError,
    green_component,
    green_from_counts,
    green_summary,
    judge_messages,
    parse_green_reply,
)
from grouprl.rewards.registry import get_reward

GREEN_LAYOUT = """[Explanation]:
The candidate misses the left effusion and calls the heart enlarged.

[Clinically Significant Errors]:
(a) False report of a finding in the candidate: 1. Cardiomegaly
(b) Missing a finding present in the reference: 1. Left pleural effusion
(c) Misidentification of a finding's anatomic location/position: 0.
(d) Misassessment of the severity of a finding: 0.
(e) Mentioning a comparison that isn't in the reference: 0.
(f) Omitting a comparison detailing a change from a prior study: 0.

[Clinically Insignificant Errors]:
(a) False report of a finding in the candidate: 0.
(b) Missing a finding present in the reference: 1. Mild degenerative changes of the spine
(c) Misidentification of a finding's anatomic location/position: 0.
(d) Misassessment of the severity of a finding: 0.
(e) Mentioning a comparison that isn't in the reference: 0.
(f) Omitting a comparison detailing a change from a prior study: 0.

[Matched Findings]:
2. No pneumothorax; no focal consolidation
"""

MARKDOWN_NUMBERED = """<think>Let me compare the two reports.</think>
## Explanation:
Severity is overstated.

**Clinically Significant Errors:**
1) False report of a finding in the candidate: 0
2) Missing a finding present in the reference: 0
3) Misidentification of a finding's anatomic location/position: 0
4) Misassessment of the severity of a finding: two
   1. large effusion (reference: small)
   2. severe edema (reference: mild)
5) Mentioning a comparison that isn't in the reference: 0
6) Omitting a comparison detailing a change from a prior study: 1

**Clinically Insignificant Errors:** None.

**Matched Findings:** 3. effusion; edema; normal heart size
"""

JSON_REPLY = """Here is my assessment:
```json
{"matched_findings": 4,
 "significant_errors": {"false_finding": 0, "missing_finding": 1, "c": 0, "(d)": 0,
                        "false_comparison": 0, "omitted_comparison": 0},
 "insignificant_errors": 2}
```"""

NO_ERRORS = """[Clinically Significant Errors]:
No clinically significant errors.

[Matched Findings]:
3. Normal heart size; clear lungs; no effusion
"""


# ---------------------------------------------------------------- GREEN formula and parsing


def test_green_from_counts():
    assert green_from_counts(2, [1, 1, 0, 0, 0, 0]) == pytest.approx(0.5)
    assert green_from_counts(3, [0] * 6) == 1.0
    assert green_from_counts(0, [2, 0, 0, 0, 0, 0]) == 0.0
    assert green_from_counts(0, [0] * 6) == 0.0  # GREEN's convention: nothing matched is 0
    with pytest.raises(ValueError):
        green_from_counts(-1, [0] * 6)


@pytest.mark.parametrize(
    "reply, matched, significant, insignificant, score",
    [
        (GREEN_LAYOUT, 2, (1, 1, 0, 0, 0, 0), 1, 0.5),
        (MARKDOWN_NUMBERED, 3, (0, 0, 0, 2, 0, 1), 0, 0.5),
        (JSON_REPLY, 4, (0, 1, 0, 0, 0, 0), 2, 0.8),
        (NO_ERRORS, 3, (0,) * 6, None, 1.0),
    ],
)
def test_parse_reply_formats(reply, matched, significant, insignificant, score):
    counts = parse_green_reply(reply)
    assert counts == GreenCounts(matched, significant, insignificant)
    assert counts.score == pytest.approx(score)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "The candidate report looks mostly fine.",
        "[Matched Findings]:\n2. effusion; edema",  # no error section
        "[Clinically Significant Errors]:\nseveral, hard to say\n\n[Matched Findings]:\n1. edema",
        "[Clinically Significant Errors]:\n(a) False report of a finding: 0.\n\n[Matched Findings]:\nsome",
    ],
)
def test_parse_reply_failures_raise(reply):
    with pytest.raises(GreenParseError):
        parse_green_reply(reply)


def test_judge_prompt_names_reports_and_layout():
    messages = judge_messages("Small left effusion.", "No effusion.")
    user = messages[-1]["content"]
    assert "Reference report:\nSmall left effusion." in user and "Candidate report:\nNo effusion." in user
    assert "[Clinically Significant Errors]:" in user and "[Matched Findings]:" in user
    assert "(f) Omitting a comparison" in user
    # The layout the judge is asked for is the layout the parser reads.
    assert parse_green_reply(GREEN_LAYOUT).matched == 2


# ---------------------------------------------------------------- a fake OpenAI-compatible judge


class FakeJudge:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 that answers from a table.

    ``replies`` maps a candidate report to the judge text; ``script`` is a list of
    (status, body) answers used first, one per request, to simulate failures.
    """

    def __init__(self, replies: dict[str, str], *, key: str = "test-key"):
        self.replies = replies
        self.key = key
        self.script: list[tuple[int, str]] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    scripted = fake.script.pop(0) if fake.script else None
                try:
                    time.sleep(0.02)
                    if self.path != "/v1/chat/completions":
                        return self._send(404, json.dumps({"error": "not found"}))
                    if self.headers.get("Authorization") != f"Bearer {fake.key}":
                        return self._send(401, json.dumps({"error": "bad key"}))
                    if scripted is not None:
                        return self._send(*scripted)
                    user = body["messages"][-1]["content"]
                    candidate = user.split("Candidate report:\n", 1)[1].split("\n\nAnswer in", 1)[0]
                    content = fake.replies[candidate]
                    reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                          "finish_reason": "stop"}]}
                    self._send(200, json.dumps(reply))
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _send(self, status, text):
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status != 200:
                    self.send_header("retry-after-ms", "1")  # a retry may follow at once: fast tests
                self.end_headers()
                self.wfile.write(data)

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
def fake_judge():
    judge = FakeJudge({"Cardiomegaly. No pneumothorax.": GREEN_LAYOUT, "Large effusion.": MARKDOWN_NUMBERED,
                       "Clear lungs.": NO_ERRORS, "Garbage.": "I cannot assess this."})
    yield judge
    judge.close()


def _judge(fake: FakeJudge, **kw) -> GreenJudge:
    return GreenJudge(fake.base_url, "green-test", api_key="test-key", backoff=0.01, **kw)


def test_fake_server_scores_batch_dedups_and_limits_concurrency(fake_judge):
    hyps = ["Cardiomegaly. No pneumothorax.", "Large effusion.", "Clear lungs.", "Clear lungs.", "Large effusion."]
    refs = ["Left effusion. No pneumothorax.", "Small effusion.", "Normal.", "Normal.", "Small effusion."]
    with _judge(fake_judge, concurrency=2) as judge:
        results = judge.score(hyps, refs)
    assert [r.score for r in results] == pytest.approx([0.5, 0.5, 1.0, 1.0, 0.5])
    assert results[0].counts.significant == (1, 1, 0, 0, 0, 0)
    assert len(fake_judge.requests) == 3  # identical pairs are judged once
    assert fake_judge.max_in_flight <= 2
    body = fake_judge.requests[0]
    assert body["model"] == "green-test" and body["temperature"] == 0.0
    summary = green_summary(results)
    assert summary["green"] == pytest.approx(0.7)
    assert summary["wrong_severity"] == pytest.approx(0.8)
    assert summary["matched_findings"] == pytest.approx((2 + 3 + 3 + 3 + 3) / 5)


def test_retries_transient_errors_then_succeeds(fake_judge):
    fake_judge.script = [(503, "overloaded"), (429, "slow down")]
    started = time.monotonic()
    with _judge(fake_judge, max_retries=3) as judge:
        result = judge.judge("Clear lungs.", "Normal.")
    assert result.score == 1.0
    assert len(fake_judge.requests) == 3
    assert time.monotonic() - started < 1.0  # the server's retry-after-ms: 1 was honoured, not the SDK's 0.5 s


def test_retries_share_one_budget_and_name_the_row(fake_judge):
    def reply(content):
        return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})

    # row 0 answered; row 1: an unusable reply, asked again, then 503s
    fake_judge.script = [reply(NO_ERRORS), reply("I cannot assess this.")] + [(503, "overloaded")] * 3
    with _judge(fake_judge, max_retries=2, concurrency=1) as judge:
        with pytest.raises(GreenError, match=r"failed after 3 attempts for row 1; last error: HTTP 503"):
            judge.score(["Clear lungs.", "Garbage."], ["Normal.", "Normal."])
    # 1 for row 0, 3 for row 1 (the re-asked reply and the SDK's retries share max_retries): never more
    assert len(fake_judge.requests) == 4


def test_client_error_is_not_retried(fake_judge):
    with GreenJudge(fake_judge.base_url, "green-test", api_key="wrong", backoff=0.01) as judge:
        with pytest.raises(GreenError, match="HTTP 401"):
            judge.score(["Clear lungs."], ["Normal."])
    assert len(fake_judge.requests) == 1


def test_unparseable_reply_raises_after_retries_never_zero(fake_judge):
    with _judge(fake_judge, max_retries=2) as judge:
        with pytest.raises(GreenError, match="unusable reply"):
            judge.score(["Clear lungs.", "Garbage."], ["Normal.", "Normal."])
    assert sum(1 for b in fake_judge.requests if "Garbage." in b["messages"][-1]["content"]) == 3


def test_server_down_raises_after_retries(monkeypatch):
    import grouprl.domains.radiology.rewards.green as green_module

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)  # the openai SDK's sync retries sleep with time.sleep
    with GreenJudge(f"http://127.0.0.1:{port}/v1", "green-test", max_retries=2, timeout=2) as judge:
        with pytest.raises(GreenError, match="failed after 3 attempts for row 0") as info:
            judge.score(["Clear lungs."], ["Normal."])
    assert "Connect" in str(info.value) and green_module.GreenJudge is GreenJudge
    assert len(waits) == 2 and waits[1] > waits[0] > 0  # it backed off, exponentially, between attempts


def test_green_component_reads_environment(fake_judge, monkeypatch):
    monkeypatch.setenv("GROUPRL_GREEN_BASE_URL", fake_judge.base_url)
    monkeypatch.setenv("GROUPRL_GREEN_MODEL", "green-test")
    monkeypatch.setenv("GROUPRL_GREEN_API_KEY", "test-key")
    assert green_component(["Clear lungs.", "Large effusion."], ["Normal.", "Small effusion."]) == [1.0, 0.5]
    assert "OpenAI-compatible" in get_component("green").backend


def test_green_component_without_configuration(monkeypatch):
    monkeypatch.delenv("GROUPRL_GREEN_BASE_URL", raising=False)
    monkeypatch.delenv("GROUPRL_GREEN_MODEL", raising=False)
    with pytest.raises(GreenError, match="GROUPRL_GREEN_BASE_URL"):
        green_component(["a"], ["b"])


def test_judge_validates_configuration():
    with pytest.raises(ValueError):
        GreenJudge("127.0.0.1:8000", "m")
    with pytest.raises(ValueError):
        GreenJudge("http://127.0.0.1:8000/v1", "")


# ---------------------------------------------------------------- EditGRPO response types


def test_extract_report_by_type():
    report = "No acute cardiopulmonary process."
    assert answers.extract_report(f"  {report}\n", "free_form") == report
    assert answers.extract_report(f"Report: \\boxed{{{report}}}", "short") == report
    assert answers.extract_report(report, "short") is None
    assert answers.extract_report("\\boxed{  }", "short") is None
    assert answers.extract_report("\\boxed{No effusion", "short") is None  # truncated box
    cot = f"<think>Heart normal, lungs clear.</think>\nFinal: \\boxed{{{report}}}"
    assert answers.extract_report(cot, "cot") == report
    assert answers.extract_report(f"\\boxed{{{report}}}", "cot") is None  # no think block
    assert answers.extract_report(f"<think>\\boxed{{{report}}}</think> done", "cot") is None  # box inside think
    assert answers.extract_report(f"<think>a</think><think>b</think>\\boxed{{{report}}}", "cot") is None
    with pytest.raises(ValueError, match="free_form"):
        answers.extract_report(report, "long")


def test_format_ok_and_extract_reports():
    texts = ["\\boxed{Clear lungs.}", "Clear lungs.", "<think>x</think>\\boxed{Edema.}"]
    assert [answers.format_ok(t, "short") for t in texts] == [True, False, True]
    assert [answers.format_ok(t, "cot") for t in texts] == [False, False, True]
    assert all(answers.format_ok(t, "free_form") for t in texts)
    reports, ok = answers.extract_reports(texts, "short")
    assert reports == ["Clear lungs.", "", "Edema."] and ok == [True, False, True]


# ---------------------------------------------------------------- CheXPO answer set F1


def test_answer_set_f1_worked_examples():
    assert answers.answer_set_f1("a, b", "a, c") == pytest.approx(0.5)
    assert answers.answer_set_f1("a, b", "b, a") == 1.0
    assert answers.answer_set_f1("<answer>Edema, Pleural Effusion</answer>", "pleural effusion, edema") == 1.0
    # Listing every label is not full credit (the any-overlap rule would give 1.0).
    many = "<answer>Atelectasis, Cardiomegaly, Consolidation, Edema, Pleural Effusion, Pneumonia</answer>"
    assert answers.answer_set_f1(many, "<answer>Edema</answer>") == pytest.approx(2 / 7)
    assert answers.answer_set_f1("a", "b") == 0.0
    assert answers.answer_set_f1("", "") == 1.0
    assert answers.answer_set_f1("", "a") == 0.0


def test_answer_labels_normalise_and_deduplicate():
    assert answers.answer_labels("<answer> Pleural_Effusion ; EDEMA, edema.,  and  Atelectasis </answer>") == {
        "pleural effusion", "edema", "atelectasis"}
    assert answers.answer_labels("<answer>x</answer> then <answer>y, z</answer>") == {"y", "z"}


def test_answer_set_f1_reward():
    reward = get_reward("answer_set_f1")
    completions = [
        "<think>Both.</think><answer>Edema, Effusion</answer>",
        "Edema, Effusion",  # no answer tags: format failure
        "<answer>edema, effusion, pneumonia, atelectasis</answer>",
        "<answer>edema</answer>",
    ]
    out = reward(["q"] * 4, completions, answer=["effusion, edema", "edema", ["Edema", "Effusion"], None])
    assert out[0] == 1.0 and out[1] == 0.0
    assert out[2] == pytest.approx(2 * 2 / (4 + 2))
    assert out[3] is None
    with pytest.raises(ValueError, match="answer"):
        reward(["q"], ["<answer>a</answer>"])


# ---------------------------------------------------------------- evaluation text cleaning


def test_clean_report():
    raw = "Lungs are clear.<|im_end|>\n Indication: cough.<|endoftext|>"
    assert answers.clean_report(raw) == "Lungs are clear."
    assert answers.clean_report(raw, cut_at_indication=False) == "Lungs are clear. Indication: cough."
    assert answers.clean_report("INDICATION: cough. Lungs clear.</s>") == "INDICATION: cough. Lungs clear."
    boxed = "<think>look</think> \\boxed{No effusion.} <|im_end|>"
    assert answers.clean_report(boxed, extract_boxed=True) == "No effusion."
    assert answers.clean_report("No effusion. [SEP] [PAD]", extract_boxed=True) == "No effusion."
    assert answers.clean_report("Keep <|im_end|>", drop_special_tokens=False) == "Keep <|im_end|>"
