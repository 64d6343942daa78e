"""The run report in a real browser: headless Chromium opens the report of a tiny vision-language run
from disk, with no console error, and the rendered page holds the run's completions, its prompt
images, drawn curves and the health alarm where it fired."""

from __future__ import annotations

import json

import pytest

from grouprl.config import config_from_dict
from grouprl.report import write_report
from grouprl.report.page import visible_text
from grouprl.trainer.grpo import GRPOTrainer

ALARM = {"step": 2, "alarm": "reward_gaming", "message": "reward/mean rose while val/report/f1 fell"}


@pytest.fixture(scope="module")
def vlm_run(image_task, tmp_path_factory):
    """A 2-step tiny VLM run validated at each step, with a health alarm at step 2 as the health
    checks write it (alarms.jsonl and health/<alarm> in metrics.jsonl) and a best checkpoint."""
    task = image_task(8, format="llava")
    run = tmp_path_factory.mktemp("report") / "run"
    cfg = {
        "data": {"train_files": [str(task.data)], "val_files": [str(task.data)],
                 "max_response_length": 8, "rollout_batch_size": 2, "val_max_samples": 2},
        "worker": {"actor": {"model": {"model_path": str(task.model)}, "optim": {"lr": 1e-3},
                             "global_batch_size": 2},
                   "rollout": {"n": 3, "val_n": 2, "val_temperature": 1.0},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 4}}]}},
        "trainer": {"output_dir": str(run), "max_steps": 2, "logger": ["jsonl"], "device": "cpu", "val_freq": 1},
    }
    GRPOTrainer(config_from_dict(cfg)).train()
    (run / "alarms.jsonl").write_text(json.dumps(ALARM) + "\n")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 1, "health/reward_gaming": 0}) + "\n")
        fh.write(json.dumps({"step": 2, "health/reward_gaming": 1}) + "\n")
    info = json.loads((run / "run_info.json").read_text())
    info["best"] = {"metric": "val/reward/mean@2", "mode": "max", "step": 1, "value": 0.25,
                    "path": str(run / "checkpoints" / "best")}
    (run / "run_info.json").write_text(json.dumps(info))
    return run


@pytest.fixture(scope="module")
def opened(browser, vlm_run):
    """The run's report written and opened in the browser (once for this module's tests): the console errors."""
    page = write_report(vlm_run)
    assert page == vlm_run / "report.html"
    return browser.open(page)


def test_report_opens_offline_and_shows_completions_images_and_curves(browser, opened, vlm_run, read_jsonl):
    assert opened == []  # no console error
    # offline: every resource the page loaded is inside the file
    assert browser.run("return performance.getEntriesByType('resource').map(e => e.name)") == []
    # each logged completion, in order, in its step's block (hidden steps included)
    rollouts = read_jsonl(vlm_run / "rollouts.jsonl")
    for step in (1, 2):
        shown = browser.run("return [...document.querySelectorAll("
                            "`#rollout-steps .step[data-step='${arguments[0]}'] pre.completion`)].map(p => p.textContent)",
                            step)
        assert shown == [visible_text(r["response"]) for r in rollouts if r["step"] == step]
    # the prompt images the run saved, decoded by the browser
    widths = browser.run("return [...document.querySelectorAll('img.prompt-image')].map(i => [i.naturalWidth, i.src.slice(0, 22)])")
    assert widths and all(w > 0 and src == "data:image/png;base64," for w, src in widths)
    # curves: plotly drew line paths in the reward chart
    paths = browser.run("return [...document.querySelectorAll(\"[data-group='reward'] .scatterlayer path.js-line\")]"
                        ".map(p => p.getAttribute('d'))")
    assert paths and all(d and d.startswith("M") for d in paths)
    # validation in the same chart as training: a dashed val/ trace beside reward/mean
    names = browser.run("return [...document.querySelectorAll(\"[data-group='reward'] .legendtext\")].map(t => t.textContent)")
    assert "reward/mean" in names and "val/reward/mean@2" in names
    text = browser.run("return document.body.innerText")
    assert "Best checkpoint: step 1, val/reward/mean@2 = 0.25" in text


def test_report_marks_the_alarm_where_it_fired(browser, opened):
    assert opened == []
    rows = browser.run("return [...document.querySelectorAll('#alarms ~ table tr.alarm')].map(r => r.innerText)")
    assert rows == ["2\treward_gaming\t" + ALARM["message"]]
    # a dotted line on every chart at step 2, labelled with the alarm
    charts = browser.run("return document.querySelectorAll('.chart').length")
    labels = browser.run("return [...document.querySelectorAll('.chart .annotation-text')].map(a => a.textContent)")
    assert charts > 1 and labels == ["reward_gaming"] * charts


def test_step_selector_shows_the_chosen_step(browser, opened):
    assert opened == []
    visible = "return [...document.querySelectorAll('#rollout-steps > .step')].filter(d => !d.hidden).map(d => d.dataset.step)"
    assert browser.run(visible) == ["2"]  # the last step first
    browser.run("const s = document.querySelector('select[data-target=rollout-steps]');"
                "s.value = '1'; s.dispatchEvent(new Event('change'));")
    assert browser.run(visible) == ["1"]


def test_multiturn_dialogue_is_shown_turn_by_turn(browser, tmp_path):
    """A Guided-GRPO rollout record (grouprl.rollout.multiturn's fields): each turn in order, the
    verifier's messages marked as such, the scalar extras beside it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {}\n")
    dialogue = [{"role": "assistant", "text": "x = 3, so <answer>\\boxed{6}</answer>", "tokens": 12},
                {"role": "user", "text": "Check 2 * 3 again.\n[SCORE] hallucination_detect=1", "tokens": 9},
                {"role": "assistant", "text": "<answer>\\boxed{6}</answer>", "tokens": 7}]
    record = {"step": 1, "id": "q1", "group": 0, "prompt": "What is 2 * 3?", "response": dialogue[-1]["text"],
              "rewards": {"accuracy": 1.0}, "score": 1.0, "advantage": 0.5, "dialogue": dialogue,
              "num_turns": 3, "stop_reason": "stop", "verifier_hallucination_score": 1.0,
              "spans": [[0, 12, "policy"], [12, 21, "between"], [21, 28, "policy"]]}
    (run / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    assert browser.open(write_report(run)) == []
    turns = browser.run("return [...document.querySelectorAll('.dialogue .turn')]"
                        ".map(t => [t.className, t.querySelector('pre').textContent])")
    assert turns == [["turn policy", dialogue[0]["text"]], ["turn verifier", dialogue[1]["text"]],
                     ["turn policy", dialogue[2]["text"]]]
    assert browser.run("return document.querySelector('.dialogue summary').textContent") == \
        "dialogue: 3 turns, stopped: stop"
    extras = browser.run("return document.querySelector('.extras').textContent")
    assert "num_turns: 3" in extras and "verifier_hallucination_score: 1" in extras and "spans" not in extras


def tool_dialogue_record() -> dict:
    """A tool-using rollout record as grouprl.rollout.multiturn writes it: a turn with a good and a malformed
    call, the results (one returning an image) under their tools' names, an environment's reply, a last turn."""
    calls = [{"type": "function", "function": {"name": "zoom", "arguments": {"region": "cardiac silhouette"}}},
             {"error": "the tool call is not valid JSON", "text": "<tool_call>{oops</tool_call>"}]
    dialogue = [
        {"role": "assistant", "text": '<tool_call>{"name": "zoom", ...}</tool_call><tool_call>{oops</tool_call>',
         "tokens": 30, "tool_calls": calls},
        {"role": "tool", "text": "[image]The cardiac silhouette, enlarged 2.3 times.\nError: malformed tool call",
         "tokens": 41, "tools": ["zoom", "error"], "images": 1,
         "results": [{"name": "zoom", "text": "[image]The cardiac silhouette, enlarged 2.3 times.", "images": 1},
                     {"name": "error", "text": "Error: malformed tool call: the tool call is not valid JSON"}]},
        {"role": "assistant", "text": "The heart is <b>enlarged</b>.", "tokens": 6},
        {"role": "user", "text": "Which side?", "tokens": 5, "environment": "radiology_quiz"},
        {"role": "assistant", "text": "Both.", "tokens": 2},
    ]
    return {"step": 1, "id": "s1", "group": 0, "prompt": "Findings?", "response": "Both.", "rewards": {"length": 0.5},
            "score": 0.5, "advantage": 0.0, "dialogue": dialogue, "num_turns": 3, "stop_reason": "stop",
            "tool_calls": 2, "spans": [[0, 30, "policy"], [30, 71, "between"], [71, 77, "policy"]]}


def test_a_tool_dialogue_shows_its_calls_results_and_counts(browser, tmp_path):
    """Each call (name and arguments; a malformed one's error), each result under its tool's name with the
    images it returned counted, an environment's message under its name, the tool-call count and stop reason."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {}\n")
    record = tool_dialogue_record()
    (run / "rollouts.jsonl").write_text(json.dumps(record) + "\n")
    assert browser.open(write_report(run)) == []
    turns = browser.run("return [...document.querySelectorAll('.dialogue .turn')]"
                        ".map(t => [t.className, t.querySelector('.who').textContent])")
    assert turns == [["turn policy", "turn 1: policy (30 tokens)"],
                     ["turn tool", "turn 2: tool results: zoom, error (1 image) (41 tokens)"],
                     ["turn policy", "turn 3: policy (6 tokens)"],
                     ["turn environment", "turn 4: environment radiology_quiz (5 tokens)"],
                     ["turn policy", "turn 5: policy (2 tokens)"]]
    calls = browser.run("return [...document.querySelectorAll('.dialogue .turn.policy .call')].map(c => c.textContent)")
    assert calls == ['zoom({"region": "cardiac silhouette"})',
                     "malformed call: the tool call is not valid JSON<tool_call>{oops</tool_call>"]
    results = browser.run("return [...document.querySelectorAll('.dialogue .turn.tool .result')]"
                          ".map(r => [r.querySelector('.tool-name').textContent, r.querySelector('pre').textContent])")
    assert results == [["zoom (1 image)", "[image]The cardiac silhouette, enlarged 2.3 times."],
                       ["error", "Error: malformed tool call: the tool call is not valid JSON"]]
    # the policy's text is shown as text, never as markup
    assert browser.run("return document.querySelectorAll('.dialogue b').length") == 0
    assert browser.run("return document.querySelector('.dialogue summary').textContent") == \
        "dialogue: 5 turns, 2 tool calls, stopped: stop"
    extras = browser.run("return document.querySelector('.extras').textContent")
    assert "num_turns: 3" in extras and "tool_calls" not in extras


def test_screenshot_renders_the_report_to_png(browser, vlm_run, tmp_path, capsys):
    """``grouprl report --screenshot``: the page as headless Chromium draws it (``browser``: skipped with
    the browser tests when there is no Chromium)."""
    from PIL import Image

    from grouprl.cli import main

    png = tmp_path / "shot.png"
    assert main(["report", str(vlm_run), "--out", str(tmp_path / "r.html"), "--screenshot", str(png)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"screenshot: {png}"
    with Image.open(png) as image:
        assert image.size == (1400, 2400)
        # the page's top is drawn: a white page with dark title text and coloured curves, not one flat colour
        assert len(image.convert("RGB").getcolors(1 << 20)) > 50


GAMED = '''
def rising(prompts, completions, trainer_state=None, **kwargs):
    return [trainer_state.global_step + 0.05 * (i % 3) for i, _ in enumerate(completions)]


def falling(prompts, completions, trainer_state=None, **kwargs):
    return [1.0 - 0.2 * trainer_state.global_step for _ in completions]
'''


def test_the_alarm_a_run_raised_is_in_its_report(browser, say_task, tmp_path):
    """Not files written by hand: a tiny run whose reward rises while a watched held-out measure falls
    raises reward_gaming itself (trainer.health), and its report shows that alarm, row and marks."""
    rewards = tmp_path / "gamed.py"
    rewards.write_text(GAMED)
    task = say_task(2)
    run = tmp_path / "run"
    cfg = task.config(run, [{"name": f"{rewards}:rising"}, {"name": f"{rewards}:falling", "weight": 0.01}], **{
        "data.val_files": [str(task.data)], "trainer.max_steps": 4, "trainer.val_freq": 2,
        "trainer.val_before_train": True, "trainer.health.max_truncation": 1.0, "trainer.logger": ["jsonl"],
        "trainer.health.watch": {f"val/rewards/{rewards}:falling/mean@1": "max"},
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 16})
    GRPOTrainer(config_from_dict(cfg)).train()
    (alarm,) = [json.loads(line) for line in (run / "alarms.jsonl").read_text().splitlines()]
    assert browser.open(write_report(run)) == []  # no console error
    rows = browser.run("return [...document.querySelectorAll('#alarms ~ table tr.alarm')].map(r => r.innerText)")
    assert rows == [f"{alarm['step']}\treward_gaming\t{alarm['message']}"]
    labels = browser.run("return [...document.querySelectorAll('.chart .annotation-text')].map(a => a.textContent)")
    assert labels and set(labels) == {"reward_gaming"}
