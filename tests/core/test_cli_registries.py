"""The command line is built from registries: commands, demos and trainer kinds by name.

The core registers `train`, `sft`, `export`, `demo` and the `grpo` trainer kind; the
domain plugins add theirs (radiology's `eval`, `generate`, `sample`, `serve rewards`
and report demos, reasoning's `--guided`, diffusion's `--flow` and `kind: flow`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from grouprl.cli import COMMANDS, DEMOS, Command, Demo, UsageError, build_parser, main
from grouprl.config import ConfigError
from grouprl.trainer.kinds import TRAINER_KINDS, TrainerKind


def test_help_lists_the_core_and_the_plugins_commands():
    text = build_parser().format_help()
    for name in ("train", "sft", "export", "demo", "generate", "eval", "sample", "serve"):
        assert name in text
    serve = build_parser().parse_args(["serve", "rewards", "--port", "5123"])
    assert serve.port == 5123 and serve.prog == "grouprl serve rewards"


def test_demo_help_lists_every_demo(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--compare", "--seeds K", "--guided", "--flow", "--quick", "--out", "--seed"):
        assert flag in text
    assert "by default: SFT then GRPO on synthetic chest X-rays" in text


@pytest.fixture
def registered_command():
    calls = []

    def arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--times", type=int, default=1)

    def run(args) -> int:
        calls.append(args.times)
        if args.times < 0:
            raise UsageError("--times must be >= 0")
        return 0

    COMMANDS.register("_t_tools count", Command("count things", run, arguments))
    try:
        yield calls
    finally:
        COMMANDS.unregister("_t_tools count")


def test_a_registered_command_joins_its_group_and_runs(registered_command, capsys):
    assert "_t_tools" in build_parser().format_help()
    assert main(["_t_tools", "count", "--times", "3"]) == 0
    assert registered_command == [3]
    assert main(["_t_tools", "count", "--times", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "grouprl _t_tools count: --times must be >= 0"


def test_a_command_entry_must_be_a_command():
    COMMANDS.register("_t_bad", "argparse:ArgumentParser")
    try:
        with pytest.raises(TypeError, match="not a grouprl.cli.Command"):
            build_parser()
    finally:
        COMMANDS.unregister("_t_bad")


@pytest.fixture
def test_demos():
    runs = []

    def run_a(out="runs/t-a", *, quick, seed):
        runs.append(("a", out, quick, seed))

    def run_b(out="runs/t-b", *, quick, seed, t_k=None):
        runs.append(("b", out, quick, seed, t_k))

    def run_a_with_b(out="runs/t-a-b", *, quick, seed):
        runs.append(("a with b", out, quick, seed))

    DEMOS.register("_t_a", Demo(run=run_a, flag="--t-a", help="demo a", combined={"--t-b": run_a_with_b}))
    DEMOS.register("_t_c", Demo(run=run_a, flag="--t-c", help="demo c"))
    DEMOS.register("_t_b", Demo(run=run_b, flag="--t-b", help="demo b",
                                options=(("--t-k", dict(type=int, metavar="K", help="b's own")),)))
    try:
        yield runs
    finally:
        DEMOS.unregister("_t_a")
        DEMOS.unregister("_t_b")
        DEMOS.unregister("_t_c")


def test_a_demo_runs_by_its_flag_with_its_own_options(test_demos, tmp_path):
    assert main(["demo", "--t-a", "--quick", "--seed", "3"]) == 0
    assert main(["demo", "--t-b", "--t-k", "2", "--out", str(tmp_path)]) == 0
    # --out reaches the demo only when given: each demo has its own default directory
    assert test_demos == [("a", "runs/t-a", True, 3), ("b", str(tmp_path), False, 0, 2)]


def test_a_demo_with_another_demos_flag_runs_its_combined_variant(test_demos):
    """``Demo.combined``: --t-a with --t-b (either order) is a's variant, as --flow --compare is."""
    assert main(["demo", "--t-b", "--t-a", "--quick"]) == 0
    assert main(["demo", "--t-a", "--t-b"]) == 0
    assert test_demos == [("a with b", "runs/t-a-b", True, 0), ("a with b", "runs/t-a-b", False, 0)]


@pytest.mark.parametrize("argv, message", [
    (["--t-b", "--t-c"], "grouprl demo: --t-b and --t-c are separate demos; choose one"),
    (["--t-a", "--t-c"], "grouprl demo: --t-a and --t-c are separate demos; choose one"),
    (["--t-b", "--t-a", "--t-k", "2"], "grouprl demo: --t-k K is an option of the --t-b demo; use it with --t-b "
                                       "(and without --t-a)"),
    (["--t-k", "2"], "grouprl demo: --t-k K is an option of the --t-b demo; use it with --t-b"),
    (["--t-a", "--t-k", "2"], "grouprl demo: --t-k K is an option of the --t-b demo; use it with --t-b "
                              "(and without --t-a)"),
])
def test_demos_are_chosen_one_at_a_time(test_demos, capsys, argv, message):
    assert main(["demo", *argv]) == 2
    assert capsys.readouterr().err.strip() == message
    assert test_demos == []


def test_one_demo_is_the_default():
    defaults = [name for name, demo in DEMOS.items() if demo.default]
    assert len(defaults) == 1  # the radiology report demo, when its plugin is installed
    with pytest.raises(TypeError, match="nothing could choose it"):  # refused when registered
        DEMOS.register("_t_none", Demo(run=print, help="neither flagged nor the default"))
    assert "_t_none" not in DEMOS


@dataclass
class _Config:
    run_dir: Path
    values: dict


class _Trainer:
    is_main = True
    trained: list = []

    def __init__(self, config):
        self.config = config

    def train(self):
        _Trainer.trained.append(self.config.values)


def test_the_kind_key_picks_the_trainer(tmp_path, capsys):
    TRAINER_KINDS.register("_t_kind", TrainerKind(config=lambda values: _Config(tmp_path, values), trainer=_Trainer))
    try:
        assert main(["train", "kind=_t_kind", "trainer.max_steps=2"]) == 0
    finally:
        TRAINER_KINDS.unregister("_t_kind")
    assert _Trainer.trained == [{"trainer": {"max_steps": 2}}]  # the kind key is the kind's, not the config's
    assert f"run directory: {tmp_path.resolve()}" in capsys.readouterr().out


def test_an_unknown_kind_is_a_config_error(capsys):
    assert main(["train", "kind=grpoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grouprl: config error: unknown trainer kind 'grpoo'") and "did you mean grpo" in err
    with pytest.raises(ConfigError, match="config key 'kind' must be a name"):
        from grouprl.trainer.kinds import trainer_kind

        trainer_kind({"kind": ["flow"]})
