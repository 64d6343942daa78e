"""`grouprl doctor`: the environment's and a config's blockers, found before a run starts (grouprl.doctor).

No weights are loaded: a model directory here is a config.json, the servers are a plain HTTP
server in a thread (up) and a port nothing listens on (down).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
import yaml

from grouprl import doctor
from grouprl.cli import main
from grouprl.doctor import BLOCKER, OK, WARN, Conflict, Row, conflict_rows, requirement_rows


@pytest.fixture
def project(tmp_path):
    """A healthy tiny config: a local model directory, a data file, a registered reward, the CPU."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "Say a", "answer": "a"}) + "\n")
    values = {
        "data": {"train_files": [str(data)]},
        "worker": {"actor": {"model": {"model_path": str(model)}},
                   "reward": {"functions": [{"name": "accuracy"}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "logger": ["jsonl"], "device": "cpu"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def run_json(capsys, *words) -> tuple[int, dict]:
    code = main(["doctor", "--json", *map(str, words)])
    return code, json.loads(capsys.readouterr().out)


def rows_for(report: dict, check: str) -> list[dict]:
    return [r for r in report["checks"] if r["check"] == check or r["check"].startswith(check)]


def test_healthy_config_passes_and_json_parses(project, capsys):
    code, report = run_json(capsys, project)
    assert code == 0
    assert report["summary"][BLOCKER] == 0
    assert sum(report["summary"].values()) == len(report["checks"])
    assert rows_for(report, "worker.actor.model.model_path")[0]["status"] == OK
    assert rows_for(report, "data.train_files")[0]["status"] == OK
    assert rows_for(report, "reward accuracy")[0]["status"] == OK
    assert {"python", "torch", "transformers", "GPUs", "distributed backends"} <= {r["check"] for r in report["checks"]}


def test_table_is_printed_without_json(project, capsys, monkeypatch):
    from grouprl.errors import FEATURE_EXTRAS, Extra

    monkeypatch.setitem(FEATURE_EXTRAS, "worker.rollout.engine: vllm",
                        Extra("no_such_vllm_module", "vllm", "worker.rollout.engine 'vllm'"))
    assert main(["doctor", str(project)]) == 0
    out = capsys.readouterr().out
    assert "grouprl doctor" in out and "reward accuracy" in out and "0 blocker" in out
    assert main(["doctor", str(project), "worker.rollout.engine=vllm"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "extra [vllm]" in out and "grouprl[vllm]" in out  # printed as written, not read as markup


def test_missing_data_file_is_a_blocker_naming_the_key(project, tmp_path, capsys):
    # an override after --json is an override too, as for grouprl train
    assert main(["doctor", str(project), "--json", f"data.val_files=[{tmp_path / 'nowhere.jsonl'}]"]) == 1
    capsys.readouterr()
    code, report = run_json(capsys, project, f"data.val_files=[{tmp_path / 'nowhere.jsonl'}]")
    assert code == 1
    (row,) = rows_for(report, "data.val_files")
    assert row["status"] == BLOCKER and "nowhere.jsonl" in row["detail"]


def test_missing_model_directory_is_a_blocker(project, tmp_path, capsys):
    code, report = run_json(capsys, project, f"worker.ref.model_path={tmp_path / 'no-model'}")
    assert code == 1
    (row,) = rows_for(report, "worker.ref.model_path")
    assert row["status"] == BLOCKER and "does not exist" in row["detail"]


def test_hub_id_in_the_cache_passes_else_warns_online_and_blocks_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    # a hub cache as huggingface_hub lays it out: refs/main names the snapshot that holds the files
    cache = tmp_path / "hub"
    repo = cache / "models--some-org--cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert doctor.model_path_row("k", "some-org/cached-model").status == OK
    assert doctor.model_path_row("k", "some-org/other-model").status == BLOCKER
    monkeypatch.delenv("HF_HUB_OFFLINE")
    row = doctor.model_path_row("k", "some-org/other-model")
    assert row.status == WARN and "not in the local cache" in row.detail


def test_unknown_reward_is_a_blocker_naming_it(project, capsys):
    code, report = run_json(capsys, project, "worker.reward.functions=[{name: acuracy}]")
    assert code == 1
    (row,) = rows_for(report, "reward acuracy")
    assert row["status"] == BLOCKER and "worker.reward.functions[0]" in row["detail"] and "acuracy" in row["detail"]


def test_tools_and_environments_are_loaded_and_a_bad_one_blocks(project, capsys):
    code, report = run_json(capsys, project, "worker.rollout.multi_turn.environment=radiology_zoom")
    (row,) = rows_for(report, "tools and environments")
    assert row["status"] == "ok" and "environments: radiology_zoom" in row["detail"] and "tools: none" in row["detail"]
    code, report = run_json(capsys, project, "worker.rollout.multi_turn.tools=[calculater]")
    (row,) = rows_for(report, "tools and environments")
    assert code == 1 and row["status"] == BLOCKER
    assert "worker.rollout.multi_turn.tools" in row["detail"] and "calculater" in row["detail"]


def test_reward_file_that_fails_to_import_is_a_blocker(project, tmp_path, capsys):
    broken = tmp_path / "broken_reward.py"
    broken.write_text("import no_such_module_here\n\ndef score(prompts, completions, **kw):\n    return [1.0]\n")
    code, report = run_json(capsys, project, f"worker.reward.functions=[{{name: '{broken}:score'}}]")
    assert code == 1
    (row,) = rows_for(report, f"reward {broken}:score")
    assert row["status"] == BLOCKER and "no_such_module_here" in row["detail"]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 -- http.server's name
        if self.path in ("/health", "/v1/models"):
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
        else:
            body = b"{}"
            self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reward_server_up_passes_and_down_blocks(project, server, capsys):
    code, report = run_json(capsys, project, f"worker.reward.reward_server={server}/predict")
    assert code == 0
    (row,) = rows_for(report, "reward server")
    assert row["status"] == OK and "ok" in row["detail"]

    down = f"http://127.0.0.1:{free_port()}"
    code, report = run_json(capsys, project, f"worker.reward.reward_server={down}/predict")
    assert code == 1
    (row,) = rows_for(report, "reward server")
    assert row["status"] == BLOCKER and down in row["detail"]


def test_verifier_endpoint_up_passes_and_down_blocks(project, server, capsys):
    # the seed's switch (use_http with backend auto) picks the http verifier, and its extra
    verifier = ["worker.rollout.verifier.enable=true", "worker.rollout.verifier.use_http=true",
                "worker.rollout.verifier.model=v"]
    code, report = run_json(capsys, project, *verifier, f"worker.rollout.verifier.base_url={server}/v1")
    (row,) = rows_for(report, "verifier")
    assert row["status"] == OK and code == 0
    assert [r["status"] for r in rows_for(report, "extra [guided]")] == [OK]
    code, report = run_json(capsys, project, "worker.rollout.verifier.use_http=true",
                            f"worker.rollout.verifier.base_url={server}/v1")
    assert rows_for(report, "verifier") == rows_for(report, "extra [guided]") == []  # not enabled: not needed
    code, report = run_json(capsys, project, *verifier,
                            f"worker.rollout.verifier.base_url=http://127.0.0.1:{free_port()}/v1")
    (row,) = rows_for(report, "verifier")
    assert row["status"] == BLOCKER and code == 1


def test_missing_extra_is_a_blocker_naming_the_pip_command(project, capsys, monkeypatch):
    from grouprl.errors import FEATURE_EXTRAS, Extra

    monkeypatch.setitem(FEATURE_EXTRAS, "worker.rollout.engine: vllm",
                        Extra("no_such_vllm_module", "vllm", "worker.rollout.engine 'vllm'"))
    code, report = run_json(capsys, project, "worker.rollout.engine=vllm")
    assert code == 1
    (row,) = rows_for(report, "extra [vllm]")
    assert row["status"] == BLOCKER and "pip install 'grouprl[vllm]'" in row["detail"]


def test_missing_logger_package_is_a_blocker_and_the_other_checks_still_run(project, capsys, monkeypatch):
    from grouprl.trainer.trackers import LOGGERS

    monkeypatch.setattr(LOGGERS.get("wandb"), "package", "no_such_wandb_module")
    code, report = run_json(capsys, project, "trainer.logger=[jsonl,wandb]")
    assert code == 1
    (row,) = rows_for(report, "extra [wandb]")
    assert row["status"] == BLOCKER and "pip install 'grouprl[wandb]'" in row["detail"]
    assert rows_for(report, "reward accuracy")[0]["status"] == OK


def test_vllm_pins_checked_against_installed_versions():
    # vLLM 0.33.0's metadata pins torch exactly (as every release does)
    reqs = ["torch==2.14.0", "transformers<5.21,>=5.16.1", "xformers; platform_system == 'Windows'",
            "pytest; extra == 'test'"]
    assert requirement_rows("vllm 0.33.0", reqs, {"torch": "2.14.0", "transformers": "5.20.2"}) == []
    assert requirement_rows("vllm 0.33.0", reqs, {"torch": "2.14.0+cpu", "transformers": "5.20.2"}) == []
    rows = requirement_rows("vllm 0.33.0", reqs, {"torch": "2.14.1", "transformers": "5.24.0"})
    assert [(r.check, r.status) for r in rows] == [("vllm 0.33.0 needs torch==2.14.0", BLOCKER),
                                                   ("vllm 0.33.0 needs transformers<5.21,>=5.16.1", BLOCKER)]
    assert "2.14.1" in rows[0].detail


def test_extra_requirements_only_when_that_extra_is_asked_for():
    reqs = ['vllm==0.33.0; extra == "vllm"', 'torch==2.14.0; extra == "vllm"', "torch<=2.14.1,>=2.4"]
    base = requirement_rows("grouprl", reqs, {"torch": "2.14.1", "vllm": None}, unmet=WARN, missing=BLOCKER)
    assert base == []  # the base requirement holds; the extra's are not asked for
    extra = requirement_rows("grouprl[vllm]", reqs, {"torch": "2.14.1", "vllm": "0.32.0"}, extra="vllm", unmet=WARN)
    assert [r.check for r in extra] == ["grouprl[vllm] needs vllm==0.33.0", "grouprl[vllm] needs torch==2.14.0"]
    assert all(r.status == WARN for r in extra)


def test_python_outside_a_packages_requires_python_is_a_blocker():
    assert doctor.python_row("vllm", ">=3.11", "3.11.7") is None
    assert doctor.python_row("vllm", None, "3.9.0") is None
    row = doctor.python_row("vllm", ">=3.11", "3.10.4")
    assert row.status == BLOCKER and row.check == "vllm needs Python >=3.11" and "3.10.4" in row.detail


def test_flash_attn_that_does_not_import_warns(monkeypatch):
    import sys

    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda dists: ("flash-attn", "2.8.3") if "flash-attn" in dists else real(dists))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as a wheel built for another torch: import fails
    row = doctor.flash_attn_row()
    assert row.status == WARN and "does not import" in row.detail
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))
    assert doctor.flash_attn_row() is None


def test_known_conflicts_warn_only_for_the_versions_they_name():
    conflict = Conflict("vllm", "==0.24.*", "transformers", ">=5.24", "profiling fails", "docs/engines.md")
    assert conflict_rows({"vllm": "0.24.0", "transformers": "5.17.0"}, [conflict]) == []
    assert conflict_rows({"vllm": "0.33.0", "transformers": "5.24.0"}, [conflict]) == []
    assert conflict_rows({"transformers": "5.24.0"}, [conflict]) == []
    (row,) = conflict_rows({"vllm": "0.24.0", "transformers": "5.24.0"}, [conflict])
    assert row.status == WARN and "docs/engines.md" in row.detail
    # the project's own table: radgraph with transformers 5
    (row,) = conflict_rows({"radgraph": "0.1.18", "transformers": "5.24.0"})
    assert row.check == "radgraph + transformers"


def test_cpu_machine_warns_when_the_config_wants_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [r.status for r in doctor.device_rows([]) if r.check == "GPUs"] == [OK]
    (row,) = [r for r in doctor.device_rows(["worker.actor.model.dtype: bfloat16"]) if r.check == "GPUs"]
    assert row.status == WARN and "bfloat16" in row.detail


def test_no_config_checks_the_environment_only(capsys):
    code, report = run_json(capsys)
    assert code == 0
    checks = {r["check"] for r in report["checks"]}
    assert {"python", "torch", "GPUs"} <= checks
    assert not any(c.startswith(("reward", "data.", "worker.", "extra")) for c in checks)


def test_unreadable_config_is_exit_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("worker: {rollout: {nn: 3}}\n")
    assert main(["doctor", str(bad)]) == 2


def test_gpus_nccl_and_backends_are_reported(monkeypatch):
    import torch
    import torch.distributed as dist

    class Props:
        name, total_memory = "NVIDIA H200", 141 * 2**30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    rows = {r.check: r for r in doctor.device_rows()}
    assert rows["GPU 1"].detail == "NVIDIA H200, 141.0 GiB" and rows["NCCL"].detail == "2.27.3"
    assert {r.status for r in rows.values()} == {OK}
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    rows = {r.check: r for r in doctor.device_rows()}
    assert rows["distributed backends"].status == WARN and "nccl no" in rows["distributed backends"].detail


def test_row_status_is_checked():
    with pytest.raises(ValueError, match="status"):
        Row("x", "fine", "")
