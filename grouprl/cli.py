"""The `grouprl` command line: thin commands over the library.

    grouprl demo                                   # synthetic chest X-ray task, CPU, no downloads
    grouprl train config.yaml worker.rollout.n=5   # GRPO-family training
    grouprl sft config.yaml                        # supervised warm start
    grouprl export runs/x/checkpoints/global_step_10 --out merged/

Under `accelerate launch -m grouprl ...` the same commands run on several processes.
"""

from __future__ import annotations

import argparse
import sys


def _config(args):
    from grouprl.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from grouprl.trainer.grpo import GRPOTrainer

    config = _config(args)
    trainer = GRPOTrainer(config)
    trainer.train()
    if trainer.is_main:
        print(f"run directory: {config.run_dir.resolve()}")
    return 0


def cmd_sft(args) -> int:
    from grouprl.trainer.sft import run_sft

    config = _config(args)
    out = run_sft(config, output_dir=args.output)
    print(f"SFT model: {out.resolve()}")
    return 0


def cmd_export(args) -> int:
    from grouprl.models.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, base_model=args.base_model, dtype=args.dtype)
    print(f"merged model: {out.resolve()}")
    return 0


def cmd_demo(args) -> int:
    from grouprl.demo import run_demo

    run_demo(args.out, quick=args.quick, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grouprl", description="Group-relative RL post-training (GRPO family).")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, fn, help_text in (("train", cmd_train, "train with a GRPO-family algorithm"),
                                ("sft", cmd_sft, "supervised warm start on the reference answers")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", nargs="?", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. worker.rollout.n=5")
        if name == "sft":
            p.add_argument("--output", help="where to save the SFT model (default <run dir>/sft_model)")
        p.set_defaults(fn=fn)

    p = sub.add_parser("export", help="write a checkpoint as a merged Hugging Face model")
    p.add_argument("checkpoint", help="a global_step_N directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--base-model", help="base model of a LoRA checkpoint (default: the adapter's recorded base)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("demo", help="SFT then GRPO on synthetic chest X-rays with a tiny Qwen2.5-VL, on CPU")
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a much shorter run, for smoke tests")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from grouprl.config import ConfigError

    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) and "=" in args.config:
        # `grouprl train key=value ...` with no file: the first override landed in `config`
        args.overrides = [args.config, *args.overrides]
        args.config = None
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"grouprl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
