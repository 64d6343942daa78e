"""The `grouprl` command line: thin commands over the library, each registered by name.

    grouprl demo                                   # synthetic chest X-ray task, CPU, no downloads
    grouprl train config.yaml worker.rollout.n=5   # GRPO-family training (`kind: flow` in the file: Flow-GRPO)
    grouprl sft config.yaml                        # supervised warm start
    grouprl validate config.yaml --checkpoint best  # the configured validation only, to validation.json
    grouprl export runs/x/checkpoints/global_step_10 --out merged/
    grouprl report runs/x                          # runs/x/report.html: open it in a browser, offline
    grouprl plan config.yaml --gpus 4 --gpu-memory 80   # memory per device before a run, and what makes it fit
    grouprl doctor config.yaml                     # what would stop the run: versions, GPUs, paths, rewards, servers
    grouprl generate --model merged/ --data test.jsonl --out preds.jsonl
    grouprl eval --data preds.jsonl --out eval/ --clean
    grouprl serve rewards --port 5000               # EditGRPO-compatible reward server
    grouprl sample --data vqa.jsonl --predictions preds.jsonl --strategy hard --n 1000 --out hard.jsonl

The core holds `train`, `validate`, `sft`, `export`, `report`, `plan`, `doctor` and `demo`; a domain plugin adds its commands to
``COMMANDS`` (the radiology plugin: `generate`, `eval`, `sample`, `serve rewards`) and its
demos to ``DEMOS`` (chosen by a flag of `grouprl demo`). The parser is built from both
registries, so building it loads the installed plugins and `grouprl --help` lists them all.

Under `accelerate launch -m grouprl ...` the same commands run on several processes.

`grouprl train` stopped by SIGTERM or SIGINT saves a checkpoint and exits with status 128 + the
signal's number (143, 130; see ``trainer.save_on_signal``).

An anticipated error (a bad config, data or YAML file, an unknown, missing or failing reward, a
missing model path or a directory with no model in it, a checkpoint where a model is expected or
the reverse, an output directory that cannot be written, a checkpoint the disk would not take (a
full disk; the previous checkpoint stays intact), an optional package not installed) is one line
on stderr naming what is wrong, and exit code 2; `grouprl --debug ...` shows its traceback
instead. A run that failed although the command was right (no step of it had a scored row)
exits with code 1 and one line. Any other error is a bug and keeps its traceback.
`grouprl --version` prints the version.

Ctrl-C during `grouprl demo` is one line and exit code 130; the same command run again continues
the run: finished stages are reused and training resumes from its checkpoint.

A closed stdout or stderr (`| tee` ended by the same Ctrl-C, `| head`) never ends a command:
``main`` puts ``grouprl.streams`` in front of both, and output nobody can read goes nowhere.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.registry import Registry, resolve


class UsageError(Exception):
    """A command used wrongly, found before it ran anything: one line on stderr, exit code 2."""


# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """One `grouprl` command: its line in `grouprl --help`, what adds its arguments to its
    parser, and ``run(args) -> exit code``.

    Registered under its name; a name of two words ("serve rewards") is a command of a group
    (`grouprl serve rewards`), the group's help taken from ``COMMAND_GROUPS``.
    """

    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None


def _check_command(name: str, command: Any) -> None:
    if not isinstance(command, Command):
        raise TypeError(f"command {name!r} is {command!r}, not a grouprl.cli.Command")


COMMANDS: Registry[Command] = Registry("command", check=_check_command)
# group -> its help, for the commands registered as "group name"
COMMAND_GROUPS = {"serve": "run a server"}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered command (the installed plugins' too)."""
    parser = argparse.ArgumentParser(prog="grouprl", description="Group-relative RL post-training (GRPO family).")
    parser.add_argument("--version", action="version", version=f"grouprl {version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of its one-line message")
    subparsers = {(): parser.add_subparsers(dest="command", required=True)}
    parser.command_parsers = {}  # a command's name (its words joined by spaces) -> its parser
    for name, command in COMMANDS.items():
        _check_command(name, command)  # one registered as an object is checked here, a reference when imported
        *group, leaf = name.split()
        for depth in range(1, len(group) + 1):
            path = tuple(group[:depth])
            if path not in subparsers:
                word = path[-1]
                group_parser = subparsers[path[:-1]].add_parser(word, help=COMMAND_GROUPS.get(word, f"{word} commands"))
                subparsers[path] = group_parser.add_subparsers(dest=f"{'_'.join(path)}_command", required=True)
        p = subparsers[tuple(group)].add_parser(leaf, help=command.help)
        if command.arguments is not None:
            command.arguments(p)
        p.set_defaults(fn=command.run, prog=p.prog)
        parser.command_parsers[name] = p
    return parser


def version() -> str:
    """grouprl's installed version (its distribution's metadata), else the package's ``__version__``."""
    import importlib.metadata

    try:
        return importlib.metadata.version("grouprl")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        from grouprl import __version__

        return __version__


def _anticipated() -> tuple[tuple[type[BaseException], str, int], ...]:
    """(error type, what the line says it is, exit code), the first match wins: the errors whose
    message names what is wrong (the key, file, record, reward, path or extra), reported in one line."""
    from grouprl.config import ConfigError
    from grouprl.data.formats import DataError
    from grouprl.data.images import ImageError
    from grouprl.errors import CheckpointSaveError, MissingExtra, ModelPathError, OutputError
    from grouprl.rewards import RewardError, RewardLoadError, UnscoredError

    return (
        (UsageError, "", 2),
        (ConfigError, "config error: ", 2),
        (DataError, "data error: ", 2),  # the message names the file, the record and the field
        (ImageError, "data error: ", 2),
        # no reward applied (exit code 1: the command was right, the run failed); names the rewards and the row or step
        (UnscoredError, "reward error: ", 1),
        # a reward that raised or broke the contract (its own file:line), or could not be loaded: the reward is wrong
        (RewardError, "reward error: ", 2),
        (RewardLoadError, "reward error: ", 2),
        (ModelPathError, "model error: ", 2),
        # a checkpoint the disk would not take (full, a quota): like an unwritable output directory, the
        # machine needs fixing, not grouprl; the previous checkpoint is intact, a run resumes from it
        (CheckpointSaveError, "checkpoint error: ", 2),
        # an output directory that cannot be written (read-only, a file in the way), found before any model loads
        (OutputError, "output error: ", 2),
        (MissingExtra, "missing package: ", 2),
    )


def _one_line(exc: BaseException) -> str:
    """The message on one line (a multi-line message's lines joined), or the error's type when it has none."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad config or data file, a bad use of a command, an unknown or failing
    reward, a missing model path or a missing optional package is one line on stderr and exit code 2,
    not a traceback (``--debug``, anywhere on the line: the traceback); so is a run stopped because
    no reward applied (exit code 1: the command was right, the run failed); a run stopped by a
    signal exits with 128 + its number. Any other error is a bug, and keeps its traceback."""
    from grouprl import streams
    from grouprl.trainer.signals import TrainingStopped

    streams.install()  # a console whose pipe closed (`| tee`, ended by the same Ctrl-C) must not end the run
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is global but may come anywhere before a "--" (grouprl train c.yaml --debug)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    argv = [a for i, a in enumerate(argv) if not (i < end and a == "--debug")]
    parser = build_parser()
    if (dashed := _dashed_override(parser, argv)) is not None:
        print(dashed, file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (grouprl validate c.yaml --checkpoint best key=value) are overrides too
        if not (hasattr(args, "overrides") and all("=" in w and not w.startswith("-") for w in extra)):
            parser.parse_args(argv)  # argparse's own usage error for what it does not know
        args.overrides = list(args.overrides) + extra
    anticipated = _anticipated()
    try:
        # a command that reads a config (train, sft): its file and overrides, or its usage (doctor: optional)
        if hasattr(args, "overrides") and not getattr(args, "config_optional", False) \
                and (usage := _config_file(args)) is not None:
            print(usage, file=sys.stderr)
            return 2
        return args.fn(args)
    except TrainingStopped as stopped:  # a signal stopped a run (train, a demo); the loop named its checkpoint
        return stopped.exit_status
    except tuple(kind for kind, _, _ in anticipated) as exc:
        if debug:
            raise
        what, code = next((what, code) for kind, what, code in anticipated if isinstance(exc, kind))
        prefix = f"{args.prog}: " if isinstance(exc, UsageError) else "grouprl: "
        print(f"{prefix}{what}{_one_line(exc)}", file=sys.stderr)
        return code


# ----------------------------------------------------------------------------- train, sft, export


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (EasyR1's form config=FILE works too)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. worker.rollout.n=5")
    p.set_defaults(config_usage=f"usage: {p.prog} CONFIG.yaml [key=value ...]")


def _config_file(args: argparse.Namespace) -> str | None:
    """Sort a config command's words into its file and its overrides, in ``args``; the usage (two
    lines) when there is neither, else None.

    ``grouprl train key=value ...`` with no file puts the first override in ``config``; EasyR1's
    launch form ``config=FILE key=value ...`` names the file as an override does.
    """
    words = ([args.config] if args.config else []) + list(args.overrides)
    if args.config and "=" not in args.config:
        words = words[1:]
    else:
        args.config = None
    named = [w for w in words if w.startswith("config=")]
    if len(named) > 1 or (named and args.config):
        files = ([args.config] if args.config else []) + [w.split("=", 1)[1] for w in named]
        raise UsageError(f"one config file, please; got {', '.join(files)}")
    if named:
        args.config = named[0].split("=", 1)[1]
    args.overrides = [w for w in words if not w.startswith("config=")]
    if args.config is None and not args.overrides:
        return (f"{args.config_usage}\n{args.prog}: give a YAML config file (examples/ has some), then dotted "
                "key=value overrides; `grouprl demo` trains without one")
    return None


def _dashed_override(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for an HF-style ``--key value`` given to a config command (train, sft), which takes
    ``key=value`` overrides; None when there is none. The key is read as a config key, then against
    the port tables (``--num_generations 4``: TRL's name for ``worker.rollout.n=4``), then by spelling."""
    from grouprl.config import all_keys, ported_name, suggest_keys

    command = parser.command_parsers.get(argv[0]) if argv else None
    if command is None or "overrides" not in {a.dest for a in command._actions}:
        return None
    known = set(command._option_string_actions)
    rest = argv[1:]
    for i, word in enumerate(rest):
        if word == "--":
            return None
        if not word.startswith("--") or word.split("=", 1)[0] in known:
            continue
        name, value = (word[2:].split("=", 1) + [None])[:2]
        if value is None and i + 1 < len(rest) and not rest[i + 1].startswith("-") and "=" not in rest[i + 1]:
            value = rest[i + 1]
        shown = f"{word} {value}" if value is not None and "=" not in word else word
        value = "VALUE" if value is None else value
        key = name.replace("-", "_")  # HF's --num-generations spells its fields with dashes too
        head = f"{command.prog}: '{shown}': overrides are key=value, not --key value"
        if key in all_keys():
            return f"{head}; write {key}={value}"
        if (ported := ported_name(key)) is not None:
            return f"{head}; write {ported.key}={value} ({key} is {ported.origin}" + (
                f"; {ported.note})" if ported.note else ")")
        near = suggest_keys(key)
        return f"{head}; '{key}' is not a config key" + (f" (did you mean {', '.join(near)}?)" if near else "")
    return None


def cmd_train(args) -> int:
    from grouprl.config import config_sources, read_config_values
    from grouprl.trainer.kinds import trainer_kind
    from grouprl.trainer.signals import exit_status

    try:
        values = read_config_values(args.config, args.overrides)
        with config_sources(values):  # an error naming a key says where it was set (file and line, command line)
            config, trainer = trainer_kind(values).build(values)  # `kind: flow` (diffusion plugin), else GRPO
        # EasyR1's key: what `grouprl validate` does, on what trainer.resume names (a registered kind's config
        # need not have the key)
        if getattr(getattr(config, "trainer", None), "val_only", False):
            return _validate_only(config, trainer)
        trainer.train()
    except KeyboardInterrupt:  # Ctrl-C before training began, or with trainer.save_on_signal false
        print("grouprl: interrupted (SIGINT); no checkpoint written", file=sys.stderr)
        return exit_status(signal.SIGINT)
    if trainer.is_main:
        print(f"run directory: {config.run_dir.resolve()}")
    unscored = getattr(trainer, "unscored", None)  # a registered trainer kind need not be a TrainingLoop
    nothing_trained = unscored.run_error() if unscored is not None else None
    if nothing_trained is not None:  # every step's loss was zero: a finished run that is still a failure
        raise nothing_trained
    return 0


def _validate_only(config, trainer) -> int:
    from grouprl.trainer import checkpoint as ckpt
    from grouprl.trainer.validation_run import run_validation

    _can_validate_alone(trainer)
    checkpoint = ckpt.resume_path(config.trainer.resume, config.checkpoint_dir, accelerator=trainer.accelerator)
    if trainer.is_main:
        print(f"grouprl: trainer.val_only: validating {checkpoint or 'the model of worker.actor.model'} "
              "and stopping, without training (as grouprl validate)", flush=True)
    run_validation(trainer, checkpoint, config.run_dir)
    return 0


def cmd_validate(args) -> int:
    from grouprl.config import ConfigError, config_sources, read_config_values
    from grouprl.registry import resolve
    from grouprl.trainer.kinds import trainer_kind
    from grouprl.trainer.validation_run import checkpoint_to_validate, run_validation

    values = read_config_values(args.config, args.overrides)
    with config_sources(values):
        kind = trainer_kind(values)
        config = resolve(kind.config)({k: v for k, v in values.items() if k != "kind"})
        if not getattr(getattr(config, "data", None), "val_files", True):  # before the model loads (grpo's, flow's key)
            raise ConfigError("config key 'data.val_files' is empty: there is nothing to validate")
        checkpoint = None if args.checkpoint is None else checkpoint_to_validate(args.checkpoint,
                                                                                 config.checkpoint_dir)
        if args.out is not None:  # everything the validation writes goes there; checkpoints stay where they are
            trainer_values = values.setdefault("trainer", {})
            trainer_values["output_dir"] = str(args.out)
            trainer_values["save_checkpoint_path"] = str(config.checkpoint_dir)
        config, trainer = kind.build(values)
    _can_validate_alone(trainer)
    run_validation(trainer, checkpoint, config.run_dir)
    return 0


def _can_validate_alone(trainer) -> None:
    if not hasattr(trainer, "validate_only"):  # a registered trainer kind need not be a TrainingLoop
        raise UsageError(f"this config's trainer ({type(trainer).__name__}) has no validation-only run")


def _validate_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.description = ("Runs the config's validation once (the metrics a training run logs under val/, its "
                     "val_generations rows) on the config's model or a checkpoint, and writes them to "
                     "validation.json in the run directory (or --out) with a table on the console. Nothing "
                     "trains and no checkpoint is written.")
    p.add_argument("--checkpoint", help="a checkpoint directory, or best (<checkpoint dir>/best) or latest (the "
                                        "newest global_step_N) of the config's run; default: the config's model")
    p.add_argument("--out", help="directory for validation.json (default: the config's run directory)")


def cmd_sft(args) -> int:
    from grouprl.config import load_config
    from grouprl.trainer.sft import run_sft

    out = run_sft(load_config(args.config, args.overrides), output_dir=args.output)
    print(f"SFT model: {out.resolve()}")
    return 0


def _sft_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument("--output", help="where to save the SFT model (default <run dir>/sft_model)")


def cmd_export(args) -> int:
    from grouprl.models.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, base_model=args.base_model, dtype=args.dtype, ema=args.ema)
    if (out / "adapter_model.safetensors").exists():
        weights = "the moving average's weights" if args.ema else "the trained weights"
        print(f"LoRA adapter ({weights}): {out.resolve()} (load it onto the base model's transformer with "
              "peft's PeftModel.from_pretrained)")
    else:
        print(f"merged model: {out.resolve()}")
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory: global_step_N, or best (trainer.best_metric)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--base-model", help="base model of a LoRA checkpoint (default: the adapter's recorded base)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ema", action="store_true",
                   help="write the checkpoint's moving average (a flow run with worker.actor.ema) as the LoRA adapter")


# ----------------------------------------------------------------------------- report


def cmd_report(args) -> int:
    from grouprl.report import RunDirError, watch_report, write_report

    caps = {"rollouts_per_step": args.max_rollouts_per_step, "steps": args.max_steps, "images": args.max_images,
            "text_chars": args.max_text_chars}
    if any(v < 1 for v in caps.values()):
        raise UsageError("the --max-... caps take a number of 1 or more")
    if args.watch is not None and (args.watch <= 0 or args.screenshot):
        raise UsageError("--watch takes a number of seconds above 0, and no --screenshot")
    try:
        if args.watch is not None:
            print(f"report: rewritten every {args.watch:g} s until Ctrl-C")
            try:
                watch_report(args.run_dir, args.watch, args.out,
                             on_write=lambda p: print(f"report: {p.resolve()}", flush=True), **caps)
            except KeyboardInterrupt:  # the way a watch ends; the last report written is whole (atomic)
                pass
            return 0
        path = write_report(args.run_dir, args.out, **caps)
    except RunDirError as exc:
        raise UsageError(str(exc)) from exc
    print(f"report: {path.resolve()}")
    if args.screenshot:
        from grouprl.report.screenshot import BrowserNotFound, screenshot

        try:
            print(f"screenshot: {screenshot(path, args.screenshot)}")
        except BrowserNotFound as exc:
            raise UsageError(str(exc)) from exc
    return 0


def _report_arguments(p: argparse.ArgumentParser) -> None:
    from grouprl.report import Caps

    p.add_argument("run_dir", help="a run directory (trainer.output_dir)")
    p.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="rewrite the report every SECONDS until Ctrl-C")
    p.add_argument("--max-rollouts-per-step", type=int, default=Caps.rollouts_per_step,
                   help="completions shown per step (whole prompt groups; default %(default)s)")
    p.add_argument("--max-steps", type=int, default=Caps.steps,
                   help="steps of the rollout browser and of the validations, spread over the run (default %(default)s)")
    p.add_argument("--max-images", type=int, default=Caps.images, help="images embedded (default %(default)s)")
    p.add_argument("--max-text-chars", type=int, default=Caps.text_chars,
                   help="characters shown of one prompt or completion (default %(default)s)")
    p.add_argument("--screenshot", metavar="PNG", help="also render the page to PNG with headless Chromium")


# ----------------------------------------------------------------------------- demos


@dataclass(frozen=True)
class Demo:
    """One demo of `grouprl demo`, chosen by its ``flag`` (``--guided``); the one registered with
    ``default=True`` runs when no flag is given.

    ``run(out=..., *, quick, seed, **options)`` runs it; ``out`` is passed only when the
    user gave ``--out`` (each demo has its own default directory, named in its help).
    ``run`` may be a ``"module:attr"`` reference, imported when the demo runs. ``options``
    are the demo's own command-line options, ``(flag, add_argument keywords)`` pairs, whose
    values reach ``run`` by their argparse names; they may not be given with another demo. An
    option several demos declare (the same flag, e.g. ``--seeds``) is one argument, for any of them.
    ``run`` may raise :class:`UsageError` for a bad use found before anything ran.
    ``combined`` maps another demo's flag to the run this demo makes when given with it
    (``--flow --compare``: the flow demo's comparison), with this demo's options.
    """

    run: Callable[..., Any] | str
    help: str
    flag: str | None = None
    default: bool = False
    options: Sequence[tuple[str, dict]] = ()
    combined: Mapping[str, Callable[..., Any] | str] = field(default_factory=dict)


QUICK_SUFFIX = "-quick"


def demo_dir(out: str | os.PathLike | None, default: str, quick: bool) -> Path:
    """A demo's run directory: ``out`` when given, else its ``default`` (``runs/demo``), with
    ``-quick`` appended for a ``--quick`` run (``runs/demo-quick``), so that a smoke test never
    overwrites the results of a full run."""
    if out is not None:
        return Path(out)
    return Path(default + QUICK_SUFFIX if quick else default)


# what a demo's run directory records of the run that made it (hidden: listings of results leave it out)
DEMO_RUN_FILE = ".demo_run.json"
# how the line naming a demo's stop checkpoint says to go on
DEMO_RESUME_HINT = "run the same grouprl demo command again to resume"


def demo_resumes(out: str | Path, settings: Mapping[str, Any], stages: Sequence[str | Path] = ()) -> bool:
    """Whether ``out`` holds an earlier run of a demo with the same ``settings`` (the demo, its seed and
    sizes), stopped or finished, which this run then continues: it reuses the stages that finished
    (an SFT model is written whole or not at all) and its RL runs resume from their last checkpoint
    (``trainer.resume: auto``). Anything else (a new directory, one of other settings or of an older
    grouprl) is a fresh start, as before: the ``stages`` this run would take up (an SFT model, the
    RL runs' checkpoint directories) are deleted first, since they belong to another run. Records
    ``settings`` for the next run either way."""
    import json
    import shutil

    from grouprl.files import write_text_atomic

    record = Path(out) / DEMO_RUN_FILE
    wanted = json.loads(json.dumps(dict(settings), sort_keys=True))
    try:
        earlier = json.loads(record.read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier != wanted:
        for stage in stages:
            shutil.rmtree(stage, ignore_errors=True)
    write_text_atomic(record, json.dumps(wanted, indent=2, sort_keys=True))
    return earlier == wanted


def _check_demo(name: str, demo: Any) -> None:
    if not isinstance(demo, Demo):
        raise TypeError(f"demo {name!r} is {demo!r}, not a grouprl.cli.Demo")
    if demo.flag is None and not demo.default:
        raise TypeError(f"demo {name!r} has no flag and is not the default: nothing could choose it")


DEMOS: Registry[Demo] = Registry("demo", error=UsageError, check=_check_demo)


class _ChooseDemo(argparse.Action):
    """A demo's flag: adds the demo to ``args.demos``, in command-line order."""

    def __init__(self, option_strings, dest, demo: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.demo = demo

    def __call__(self, parser, namespace, values, option_string=None):
        chosen = list(getattr(namespace, self.dest, None) or [])
        if self.demo not in chosen:
            chosen.append(self.demo)
        setattr(namespace, self.dest, chosen)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    demos = DEMOS.items()
    for name, demo in demos:
        _check_demo(name, demo)  # a demo registered as an object is checked here, a reference when imported
    default = [demo.help for _, demo in demos if demo.default]
    p.description = "Runs a demo on CPU with tiny models and synthetic data, downloading nothing" + (
        f"; by default: {default[0]}" if len(default) == 1 else "") + "."
    p.add_argument("--out", help="run directory (default: the demo's own, under runs/)")
    p.add_argument("--quick", action="store_true",
                   help=f"a much shorter run, for smoke tests, in its own directory (the demo's default with "
                        f"{QUICK_SUFFIX} appended, e.g. runs/demo{QUICK_SUFFIX})")
    # option's dest -> (the demos that take it, how to name it, its default)
    owned: dict[str, tuple[list[str], str, Any]] = {}
    actions: dict[str, argparse.Action] = {}
    for name, demo in demos:
        if demo.flag:
            p.add_argument(demo.flag, action=_ChooseDemo, demo=name, dest="demos", default=[], help=demo.help)
        for flag, kwargs in demo.options:
            if flag in actions:  # several demos take the same option (--seeds): one argument, each one's help
                action = actions[flag]
                owned[action.dest][0].append(name)
                action.help = f"{action.help}; {kwargs['help']}" if kwargs.get("help") else action.help
                continue
            action = actions[flag] = p.add_argument(flag, **kwargs)
            owned[action.dest] = ([name], f"{flag} {action.metavar}" if action.metavar else flag, action.default)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(demos=[], demo_options=owned)


def _and(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"


def cmd_demo(args) -> int:
    demos = dict(DEMOS.items())
    chosen: list[str] = args.demos
    run = None
    if len(chosen) == 2:  # one demo's variant named by another's flag (--flow --compare)
        for first, second in (chosen, chosen[::-1]):
            if demos[second].flag in demos[first].combined:
                run, chosen = demos[first].combined[demos[second].flag], [first]
                break
    for dest, (owners, option, unset) in args.demo_options.items():  # a demo's options go with its demos alone
        if getattr(args, dest) == unset or (len(chosen) == 1 and chosen[0] in owners):
            continue
        if not chosen and any(demos[o].default for o in owners):
            continue
        if len(owners) > 1:
            if len(chosen) > 1 and set(chosen) <= set(owners):
                continue  # several demos chosen: said below
            flags = [demos[o].flag or "the default demo" for o in owners]
            raise UsageError(f"{option} is an option of the {_and(flags)} demos; use it with one of them")
        owner = owners[0]
        flag = demos[owner].flag
        others = [demos[n].flag for n in chosen if n != owner]
        if flag is None:
            raise UsageError(f"{option} is an option of the default demo; use it without {' or '.join(others)}")
        raise UsageError(f"{option} is an option of the {flag} demo; use it with {flag}"
                         + (f" (and without {' or '.join(others)})" if others else ""))
    if len(chosen) > 1:
        raise UsageError(f"{_and([demos[n].flag for n in chosen])} are separate demos; choose one")
    if chosen:
        name = chosen[0]
    else:
        defaults = [n for n, demo in demos.items() if demo.default]
        flags = ", ".join(demo.flag for demo in demos.values() if demo.flag) or "none installed"
        if len(defaults) != 1:
            what = "no demo is" if not defaults else f"demos {', '.join(defaults)} are each"
            raise UsageError(f"{what} registered as the default; choose one with its flag ({flags})")
        name = defaults[0]
    options = {dest: getattr(args, dest) for dest, (owners, _, _) in args.demo_options.items() if name in owners}
    out = {"out": args.out} if args.out else {}
    if args.out:  # before the demo builds anything
        from grouprl.files import check_writable_dir

        check_writable_dir(args.out, "demo's run directory (--out)", create=False)
    try:
        resolve(run or demos[name].run)(**out, quick=args.quick, seed=args.seed, **options)
    except KeyboardInterrupt:  # Ctrl-C outside a training run (data, SFT, evaluation): what finished is kept
        from grouprl.trainer.signals import exit_status

        print(f"grouprl: demo interrupted (SIGINT); the stages that finished are kept: {DEMO_RESUME_HINT}",
              file=sys.stderr)
        return exit_status(signal.SIGINT)
    return 0


COMMANDS.register("train", Command("train with a GRPO-family algorithm (or the trainer the file's `kind` names)",
                                   cmd_train, _config_arguments))
COMMANDS.register("validate", Command("run the configured validation on a model or a checkpoint, without training",
                                      cmd_validate, _validate_arguments))
COMMANDS.register("sft", Command("supervised warm start on the reference answers", cmd_sft, _sft_arguments))
COMMANDS.register("export", Command("write a checkpoint as a merged Hugging Face model", cmd_export,
                                    _export_arguments))
COMMANDS.register("report", Command("write a run's HTML report (curves, rollouts, validation, alarms), offline",
                                    cmd_report, _report_arguments))
COMMANDS.register("demo", Command("run a demo on CPU with tiny models, nothing downloaded (grouprl demo --help "
                                  "lists them)", cmd_demo, _demo_arguments))
COMMANDS.register("doctor", "grouprl.doctor:DOCTOR")
COMMANDS.register("plan", "grouprl.planning.command:PLAN")


if __name__ == "__main__":  # `python -m grouprl.cli`: the imported module holds what the plugins register
    from grouprl.cli import main as registered_main

    sys.exit(registered_main())
