"""The run report without a browser: reading a run directory (in progress, damaged), caps and
what they leave out, alarm steps, metric groups, the command line, --watch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grouprl.cli import main
from grouprl.report import RunDirError, watch_report, write_report
from grouprl.report.charts import alarm_steps, metric_groups
from grouprl.report.page import spread_steps
from grouprl.report.reading import read_run


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def make_run(root: Path, steps: int = 3, n: int = 4) -> Path:
    """A run directory as a GRPO run writes it: ``steps`` steps of 2 prompt groups of ``n`` completions."""
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  max_steps: 10\n")
    (run / "run_info.json").write_text(json.dumps({"num_processes": 1}))
    (run / "metrics.jsonl").write_text(lines(*[{"step": s, "reward/mean": s / 10, "actor/entropy": 1.0}
                                              for s in range(1, steps + 1)]))
    (run / "rollouts.jsonl").write_text(lines(*[
        {"step": s, "id": f"p{g}", "group": g, "prompt": f"prompt {g}", "response": f"answer {s}.{g}.{i}",
         "rewards": {"accuracy": 1.0}, "score": 1.0, "advantage": 0.0}
        for s in range(1, steps + 1) for g in range(2) for i in range(n)]))
    return run


def test_a_line_being_written_is_left_out_and_a_broken_one_is_counted(tmp_path):
    run = make_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "reward/me')  # the run is writing it
    read = read_run(run)
    assert read.metrics["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.3)] and read.bad_lines == {}
    text = (run / "metrics.jsonl").read_text().replace('{"step": 4, "reward/me', 'not json\n')
    (run / "metrics.jsonl").write_text(text)
    assert read_run(run).bad_lines == {"metrics.jsonl": 1}
    assert "metrics.jsonl: 1" in write_report(run).read_text()


def test_missing_and_non_run_directories_are_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(RunDirError, match="no such run directory"):
        write_report(tmp_path / "nope")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"grouprl report: {tmp_path}: not a run directory (it has none of config.yaml, run_info.json, metrics.jsonl)"


def test_command_writes_report_html_in_the_run_directory(tmp_path, capsys):
    run = make_run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {run / 'report.html'}"
    page = (run / "report.html").read_text()
    assert "answer 3.1.3" in page
    loads_from_network = re.search(r"""<(script|img|link)[^>]+(src|href)=["']?(https?:)?//""", page) is not None
    assert not loads_from_network  # plotly.js inline, images as data: URIs
    assert main(["report", str(run), "--out", str(tmp_path / "elsewhere.html")]) == 0
    assert (tmp_path / "elsewhere.html").exists()


def test_rollout_cap_keeps_whole_groups_and_says_what_it_left_out(tmp_path):
    run = make_run(tmp_path, steps=1, n=4)
    page = write_report(run, rollouts_per_step=5).read_text()
    assert "answer 1.0.3" in page and "answer 1.1.0" not in page  # group 1 would pass the cap of 5
    assert "4 of 8 rollouts shown; 4 left out (cap: 5 per step" in page


def test_step_cap_spreads_steps_over_the_run_and_says_how_many_it_left_out(tmp_path):
    assert spread_steps([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [1, 5, 9]
    assert spread_steps([1, 2], 5) == [1, 2] and spread_steps([4, 7, 9], 1) == [9]
    run = make_run(tmp_path, steps=6, n=1)
    page = write_report(run, steps=2).read_text()
    assert "answer 1.0.0" in page and "answer 6.0.0" in page and "answer 3.0.0" not in page
    assert "2 of 6 logged steps embedded; 4 left out (cap: 2, --max-steps)" in page


def test_text_cap_cuts_long_completions_with_a_note(tmp_path):
    run = make_run(tmp_path, steps=1, n=1)
    page = write_report(run, text_chars=7).read_text()
    assert "answer " in page and "answer 1.0.0" not in page and "(5 more characters)" in page


def test_images_are_embedded_from_the_run_directory_only_up_to_the_cap(tmp_path):
    from PIL import Image

    run = make_run(tmp_path, steps=1, n=1)
    (run / "prompt_images").mkdir()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(run / "prompt_images" / "a.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "outside.png")
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    records[0]["images"] = ["prompt_images/a.png", str(tmp_path / "outside.png")]
    records[1]["images"] = ["prompt_images/a.png"]
    (run / "rollouts.jsonl").write_text(lines(*records))
    page = write_report(run, images=1).read_text()
    assert page.count('<img class="prompt-image" src="data:image/png;base64,') == 1
    assert f"image {tmp_path / 'outside.png'}: not a file in the run directory" in page
    assert "image prompt_images/a.png left out (cap of 1 images)" in page
    assert "1 images left out (cap: 1, --max-images)" in page


def test_alarm_steps_come_from_alarms_jsonl_and_health_metrics():
    alarms = [{"step": 4, "alarm": "nan", "message": "x"}]
    metrics = {"health/reward_gaming": [(1, 0.0), (2, 1.0), (3, 1.0), (4, 0.0), (5, 1.0)],
               "health/nan": [(4, 1.0)], "reward/mean": [(1, 1.0)]}
    assert alarm_steps(alarms, metrics) == {2: ["reward_gaming"], 4: ["nan"], 5: ["reward_gaming"]}


def test_metric_groups_put_validation_beside_training_and_se_as_error_bars():
    keys = ["reward/mean", "val/reward/mean@4", "val/reward/mean@4_se", "val/report/finding_f1_micro",
            "timing/step_s", "frac_reward_zero_std", "actor/entropy", "health/nan"]
    assert metric_groups(keys) == {"reward": ["reward/mean", "val/reward/mean@4"], "health": ["health/nan"],
                                   "actor": ["actor/entropy"], "overall": ["frac_reward_zero_std"],
                                   "report": ["val/report/finding_f1_micro"], "timing": ["timing/step_s"]}


def test_watch_rewrites_the_report_as_the_run_goes_on(tmp_path):
    run = make_run(tmp_path, steps=1, n=1)
    seen = []

    def next_step(path):  # between two writes the run logs its next step
        seen.append("answer 2.0.0" in path.read_text())
        with open(run / "rollouts.jsonl", "a") as fh:
            fh.write(lines({"step": 2, "group": 0, "prompt": "p", "response": "answer 2.0.0"}))

    watch_report(run, 0.01, rounds=2, on_write=next_step)
    assert seen == [False, True]


def test_best_checkpoint_and_checkpoints_are_listed(tmp_path):
    run = make_run(tmp_path, steps=1, n=1)
    assert "<b>Best checkpoint</b>: none" in write_report(run).read_text()
    (run / "run_info.json").write_text(json.dumps({"best": {"metric": "val/report/finding_f1_micro", "mode": "max",
                                                             "step": 20, "value": 0.5, "path": "/x/best"}}))
    for name, step in (("global_step_20", 20), ("best", 20)):
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    page = write_report(run).read_text()
    assert "step 20, val/report/finding_f1_micro = 0.5 (max)" in page
    assert "<td>global_step_20</td><td>20</td>" in page and "<td>best</td><td>20</td>" in page
