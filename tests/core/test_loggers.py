"""The loggers of trainer.logger with their real packages, offline: what a run sends each one is read back.

W&B runs with WANDB_MODE=offline (its offline run files are read), MLflow with its default SQLite
store under the run directory (read with MlflowClient), Trackio in its local mode (in a subprocess:
TRACKIO_DIR is read when trackio is imported). Nothing reaches a network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from grouprl.config import ConfigError, config_from_dict, load_config
from grouprl.trainer.logging import MetricsLogger, samples_due
from grouprl.trainer.trackers import flatten_config, markdown_table, mlflow_name, sample_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# ---------------------------------------------------------------------------- pure parts

RECORDS = [
    {"id": "a", "group": 0, "prompt": "Say yes", "response": "yes | no\nmaybe", "reference": "yes",
     "rewards": {"accuracy": 1.0, "length": 0.5}, "score": 1.25, "advantage": 0.7, "truncated": False,
     "token_ids": [1, 2, 3], "logged": {"x": 1}},
    {"id": "b", "group": 0, "prompt": "Say yes", "response": "no", "reference": "yes",
     "rewards": {"accuracy": 0.0, "length": 0.5}, "score": 0.25, "advantage": -0.7, "truncated": True,
     "data_source": "say"},
]


def test_sample_table_flattens_rewards_and_leaves_out_nested_fields():
    table = sample_table("train", 3, RECORDS)
    assert table.columns == ["step", "id", "group", "prompt", "response", "reference", "score", "advantage",
                             "reward/accuracy", "reward/length", "truncated", "data_source"]
    assert table.rows[0][:4] == [3, "a", 0, "Say yes"]
    assert table.rows[1][table.columns.index("reward/accuracy")] == 0.0
    assert table.rows[0][-1] is None  # a column the first record lacks
    assert len(sample_table("train", 3, RECORDS, limit=1, images=[("x", None)] * 3).rows) == 1
    assert len(sample_table("train", 3, RECORDS, limit=1, images=[("x", None)] * 3).images) == 1


def test_markdown_table_keeps_each_completion_in_its_cell():
    text = markdown_table(sample_table("train", 3, RECORDS[:1]))
    lines = text.splitlines()
    assert len(lines) == 3  # header, rule, one row: the completion's line break is a <br>
    assert "yes \\| no<br>maybe" in lines[2]


def test_mlflow_names_and_flattened_params():
    assert mlflow_name("val/reward/mean@4") == "val/reward/mean_at_4"
    assert mlflow_name("val/report/finding f1 (micro)") == "val/report/finding f1 _micro_"
    assert flatten_config({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": "x"}) == {"a.b": "1", "a.c": "[1, 2]",
                                                                              "a.d": "{}", "e": "x"}


def test_samples_cadence_and_its_config_checks():
    assert [s for s in range(1, 7) if samples_due(s, 2)] == [2, 4, 6]
    assert not any(samples_due(s, -1) for s in range(1, 7))
    with pytest.raises(ConfigError, match="trainer.log_samples_freq"):
        load_config(None, ["trainer.log_samples_freq=0"])
    with pytest.raises(ConfigError, match="trainer.logger.*swanlab"):
        load_config(None, ["trainer.logger=[jsonl,swanlab]"])


# ---------------------------------------------------------------------------- a VLM run, every logger


def _tb_events(directory: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_vlm_run_sends_scalars_tables_and_images_to_every_logger(image_task, tmp_path, read_jsonl):
    from mlflow.tracking import MlflowClient

    from grouprl.trainer.grpo import GRPOTrainer

    task = image_task(4, format="llava")
    run = tmp_path / "run"
    cfg = {
        "data": {"train_files": [str(task.data)], "val_files": [str(task.data)],
                 "max_response_length": 6, "rollout_batch_size": 2, "val_max_samples": 2},
        "worker": {"actor": {"model": {"model_path": str(task.model)}, "global_batch_size": 2},
                   "rollout": {"n": 2, "val_n": 2},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 4}}]}},
        "trainer": {"output_dir": str(run), "max_steps": 2, "device": "cpu", "val_freq": 2,
                    "logger": ["jsonl", "tensorboard", "wandb", "mlflow"], "log_samples_freq": 1,
                    "log_samples_rows": 3, "experiment_name": "vlm"},
    }
    GRPOTrainer(config_from_dict(cfg)).train()
    rollouts = read_jsonl(run / "rollouts.jsonl")
    completion = next(r["response"] for r in [r for r in rollouts if r["step"] == 1][:3] if r["response"].strip())
    val = read_jsonl(run / "val_generations.jsonl")
    ids = json.loads((run / "tracking.json").read_text())

    # TensorBoard: the samples as Markdown text, the prompt images, the scalars
    tb = _tb_events(run / "tensorboard")
    texts = {t: [e.tensor_proto.string_val[0].decode() for e in tb.Tensors(t)] for t in tb.Tags()["tensors"]}
    assert any(completion.replace("|", "\\|").replace("\n", "<br>") in t for t in texts["samples/train/text_summary"])
    assert any(val[0]["id"] in t for t in texts["samples/val/text_summary"])
    assert "samples/train/image_0" in tb.Tags()["images"]
    assert "reward/mean" in tb.Tags()["scalars"]

    # W&B (offline): the run's tables and images, under the id tracking.json keeps
    offline = list((run / "wandb").glob(f"offline-run-*-{ids['wandb']['id']}"))
    assert len(offline) == 1
    tables = {p.name: json.loads(p.read_text())  # train_<step>_<hash>.table.json, val_...
              for p in (offline[0] / "files" / "media" / "table" / "samples").glob("*.table.json")}
    train_tables = [t for p, t in tables.items() if p.startswith("train")]
    assert train_tables and "response" in train_tables[0]["columns"] and "advantage" in train_tables[0]["columns"]
    assert any(completion in row for t in train_tables for row in t["data"])
    assert len(train_tables[0]["data"]) <= 3  # trainer.log_samples_rows
    assert any(p.startswith("val") for p in tables)
    assert list((offline[0] / "files" / "media" / "images").rglob("*.png"))

    # MLflow: the SQLite store in the run directory
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    assert ids["mlflow"]["tracking_uri"] == f"sqlite:///{(run / 'mlflow' / 'mlflow.db').resolve()}"
    run_id = ids["mlflow"]["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2]
    assert [m.step for m in client.get_metric_history(run_id, "val/reward/mean_at_2")] == [2]
    params = client.get_run(run_id).data.params
    assert params["worker.rollout.n"] == "2" and params["trainer.experiment_name"] == "vlm"
    table = json.loads(Path(client.download_artifacts(run_id, "samples/train/step_000001.json", str(tmp_path)))
                       .read_text())
    assert completion in [row[table["columns"].index("response")] for row in table["data"]]
    assert client.list_artifacts(run_id, "images")  # the prompt images (log_image)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_and_wandb_resume_continue_their_runs_without_logging_a_step_twice(tmp_path):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    grid = Image.new("RGB", (16, 8), (200, 10, 10))
    first = MetricsLogger(run, ["mlflow", "wandb"], total_steps=4, config={"a": {"b": 1}}, resume_step=-1)
    for step in (1, 2, 3):  # killed after logging step 3; its checkpoint is step 2
        first.log(step, {"loss": float(step)})
    first.log_samples(3, "val", [{"prompt": "p", "score": 1.0}], images=[("grid", grid)])
    first.close()
    ids = json.loads((run / "tracking.json").read_text())
    resumed = MetricsLogger(run, ["mlflow", "wandb"], total_steps=4, config={"a": {"b": 2}, "c": 3}, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    assert json.loads((run / "tracking.json").read_text()) == ids

    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name("grouprl")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    history = [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"]["run_id"], "loss")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]  # step 3 once, as first logged
    params = client.get_run(ids["mlflow"]["run_id"]).data.params
    assert params == {"a.b": "1", "c": "3"}  # MLflow params are immutable: a new key is added
    assert client.list_artifacts(ids["mlflow"]["run_id"], "samples/val")
    # a fresh start opens new tracker runs
    MetricsLogger(run, ["mlflow", "wandb"], total_steps=4, resume_step=-1).close()
    again = json.loads((run / "tracking.json").read_text())
    assert again["mlflow"]["run_id"] != ids["mlflow"]["run_id"] and again["wandb"]["id"] != ids["wandb"]["id"]
    # both W&B attempts of the resumed run wrote under its one id (wandb sync joins them)
    assert len(list((run / "wandb").glob(f"offline-run-*-{ids['wandb']['id']}"))) >= 1


TRACKIO_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from PIL import Image
    from grouprl.trainer.logging import MetricsLogger
    from trackio.sqlite_storage import SQLiteStorage

    run = Path(sys.argv[1])
    first = MetricsLogger(run, ["trackio"], total_steps=4, project="grouprl-test", experiment="e", resume_step=-1)
    for step in (1, 2, 3):
        first.log(step, {"loss": float(step), "val/reward/mean@4": 0.5})
    first.log_samples(2, "train", [{"prompt": "Say yes", "response": "yes sir", "advantage": 1.0}],
                      images=[("grid", Image.new("RGB", (8, 8), (0, 200, 0)))])
    first.close()
    resumed = MetricsLogger(run, ["trackio"], total_steps=4, project="grouprl-test", experiment="e", resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    name = json.loads((run / "tracking.json").read_text())["trackio"]["name"]
    logs = SQLiteStorage.get_logs("grouprl-test", name)
    print(json.dumps({"runs": SQLiteStorage.get_runs("grouprl-test"), "name": name, "logs": logs}, default=str))
""")


def test_trackio_local_store_gets_scalars_table_and_image_and_resume_continues(tmp_path):
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "run")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # trackio prints its own lines, one at exit too
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith('{"runs"')))
    assert result["runs"] == [result["name"]] and result["name"].startswith("e-")
    logs = result["logs"]
    loss = sorted((row["step"], row["loss"]) for row in logs if "loss" in row)
    assert loss == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]  # step 3 once, as first logged
    assert any("val/reward/mean@4" in row for row in logs)
    table = next(row["samples/train"] for row in logs if "samples/train" in row)
    assert "yes sir" in json.dumps(table)
    image = next(row["samples/train/image_0"] for row in logs if "samples/train/image_0" in row)
    assert list((tmp_path / "trackio").rglob(Path(image["file_path"]).name))
