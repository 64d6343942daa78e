"""The `grouprl` command line: thin commands over the library.

    grouprl demo                                   # synthetic chest X-ray task, CPU, no downloads
    grouprl train config.yaml worker.rollout.n=5   # GRPO-family training
    grouprl sft config.yaml                        # supervised warm start
    grouprl export runs/x/checkpoints/global_step_10 --out merged/
    grouprl generate --model merged/ --data test.jsonl --out preds.jsonl
    grouprl eval --data preds.jsonl --out eval/ --clean
    grouprl serve rewards --port 5000               # EditGRPO-compatible reward server
    grouprl sample --data vqa.jsonl --predictions preds.jsonl --strategy hard --n 1000 --out hard.jsonl

Under `accelerate launch -m grouprl ...` the same commands run on several processes.
"""

from __future__ import annotations

import argparse
import os
import sys


def _config(args):
    from grouprl.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from grouprl.config import read_config_values

    values = read_config_values(args.config, args.overrides)
    if values.get("kind") == "flow":  # a flow-matching image model: Flow-GRPO and its family
        from grouprl.domains.diffusion.config import flow_config_from_dict
        from grouprl.domains.diffusion.trainer import FlowGRPOTrainer

        config = flow_config_from_dict(values)
        trainer = FlowGRPOTrainer(config)
    else:
        from grouprl.config import config_from_dict
        from grouprl.trainer.grpo import GRPOTrainer

        config = config_from_dict(values)
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
    from grouprl.domains.radiology.demo import run_demo

    if args.seeds is not None:
        if not args.compare or args.guided or args.flow:
            print("grouprl demo: --seeds K repeats the --compare demo over K seeds; use it with --compare "
                  "(and without --guided or --flow)", file=sys.stderr)
            return 2
        from grouprl.domains.radiology.demo import check_seed_dirs, run_compare_seeds

        out = args.out or "runs/demo-compare"
        try:  # before anything runs: K >= 1, and no seed directory holds another run's results
            check_seed_dirs(out, seeds=args.seeds, seed=args.seed, quick=args.quick)
        except ValueError as exc:
            print(f"grouprl demo: {exc}", file=sys.stderr)
            return 2
        run_compare_seeds(out, seeds=args.seeds, seed=args.seed, quick=args.quick)
        return 0
    if args.flow:
        if args.compare or args.guided:
            print("grouprl demo: --flow, --guided and --compare are separate demos; choose one", file=sys.stderr)
            return 2
        from grouprl.domains.diffusion.demo import run_flow_demo

        run_flow_demo(args.out or "runs/demo-flow", quick=args.quick, seed=args.seed)
        return 0
    if args.guided:
        if args.compare:
            print("grouprl demo: --guided and --compare are separate demos; choose one", file=sys.stderr)
            return 2
        from grouprl.domains.reasoning.demo import run_guided_demo

        run_guided_demo(args.out or "runs/demo-guided", quick=args.quick, seed=args.seed)
        return 0
    run_demo(args.out or "runs/demo", quick=args.quick, seed=args.seed, compare=args.compare)
    return 0


def _names(values: list[str] | None) -> list[str] | None:
    """`--components a b` or `--components a,b` -> ["a", "b"]."""
    if not values:
        return None
    return [name for value in values for name in value.split(",") if name.strip()]


def cmd_eval(args) -> int:
    from grouprl.domains.radiology.evaluation import EvalDataError, evaluate_file
    from grouprl.rewards.judge import JudgeError, judge_from_options

    try:
        judge = None
        if args.task == "conversation":
            judge = judge_from_options(args.judge_base_url, args.judge_model, api_key_env=args.judge_api_key_env,
                                       timeout=args.judge_timeout, max_retries=args.judge_retries,
                                       concurrency=args.judge_concurrency)
        summary = evaluate_file(args.data, args.out, task=args.task, components=_names(args.components),
                                clean=args.clean, bootstrap=args.bootstrap, seed=args.seed, corpus=not args.no_corpus,
                                corpus_bootstrap=args.corpus_bootstrap, iou_threshold=args.iou_threshold,
                                box_labels=args.box_labels, judge=judge, judge_on_failure=args.judge_on_failure,
                                progress=lambda message: print(message, file=sys.stderr))
    except (EvalDataError, ValueError) as exc:  # bad records, unknown components, bad options
        print(f"grouprl eval: {exc}", file=sys.stderr)
        return 2
    except JudgeError as exc:  # the judge failed for a record after its retries: no score is made up
        print(f"grouprl eval: {exc} (--judge-on-failure skip leaves such records unscored)", file=sys.stderr)
        return 1
    finally:
        if judge is not None:
            judge.close()
    for m in summary["metrics"]:
        value = "undefined" if m["value"] is None else f"{m['value']:.4f}"
        ci = f"  [{m['ci_low']:.4f}, {m['ci_high']:.4f}]" if m["ci_low"] is not None else ""
        print(f"{m['metric']:<40} {value}{ci}  ({m['backend']})")
    for record in summary.get("unscored", []):
        print(f"unscored: id {record['id']!r}: {record['error']}", file=sys.stderr)
    unscored = f", {summary['n_unscored']} unscored" if summary.get("n_unscored") else ""
    print(f"wrote {args.out}/per_sample.csv, summary.json, summary.csv ({summary['n_samples']} samples{unscored})")
    return 0


def cmd_generate(args) -> int:
    from grouprl.domains.radiology.evaluation import generate_file

    load = {"format": args.format, "id_key": args.id_key}
    if args.image_dir:
        load["image_dir"] = args.image_dir
    if args.system_prompt is not None:
        load["system_prompt"] = args.system_prompt
    n = generate_file(args.model, args.data, args.out, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      seed=args.seed, dtype=args.dtype, device=args.device, max_samples=args.max_samples,
                      max_prompt_length=args.max_prompt_length, load_kwargs=load,
                      show_progress=not args.no_progress, task=args.task)
    print(f"wrote {n} responses to {args.out}")
    return 0


def cmd_serve_rewards(args) -> int:
    import os

    from grouprl.domains.radiology.server.app import serve

    token = args.token if args.token is not None else os.environ.get("GROUPRL_REWARD_TOKEN") or None
    from grouprl.domains.radiology.server.app import DEFAULT_COMPONENTS

    try:
        serve(args.host, args.port, args.workers, token, ports=args.ports,
              default_components=_names(args.components) or list(DEFAULT_COMPONENTS), max_batch=args.max_batch,
              max_chars=args.max_chars, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
              default_type=args.default_type, scoring_threads=args.scoring_threads,
              class_frequencies=args.class_frequencies, entity_embeddings=args.entity_embeddings,
              entity_encoder=args.entity_encoder, log_level=args.log_level)
    except (ValueError, OSError, ImportError) as exc:  # bad settings, missing files or packages, a busy port
        print(f"grouprl serve rewards: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_sample(args) -> int:
    from grouprl.domains.radiology.sample_selection import (SamplingError, candidate_indices, group_by_type, read_records,
                                       stratified_sample, write_records)

    try:
        if args.out and os.path.abspath(args.out) == os.path.abspath(args.data):
            raise SamplingError(f"--out {args.out} is the input file; write the sample to a new file")
        records, layout = read_records(args.data)
        predictions = read_records(args.predictions)[0] if args.predictions else None
        pool = candidate_indices(records, strategy=args.strategy, predictions=predictions,
                                 threshold=args.threshold, answer_key=args.answer_key, id_key=args.id_key)
        kept = [records[i] for i in pool]
        if not kept:
            raise SamplingError(f"the predictions get all {len(records)} items right (answer-set F1 >= "
                                f"{args.threshold}); there are no hard items to keep")
        if args.n is not None and args.n > len(kept):
            what = "items the model gets wrong" if args.strategy == "hard" else "items"
            raise SamplingError(f"asked for --n {args.n} but only {len(kept)} {what} are available"
                                + (f" (of {len(records)})" if args.strategy == "hard" else ""))
        chosen = stratified_sample(kept, n=args.n, seed=args.seed, type_key=args.question_type_key or None)
        sample = [kept[i] for i in chosen]
        write_records(args.out, sample, layout)
    except SamplingError as exc:
        print(f"grouprl sample: {exc}", file=sys.stderr)
        return 2
    if args.strategy == "hard":
        print(f"hard: the predictions get {len(kept)} of {len(records)} items wrong "
              f"(answer-set F1 < {args.threshold})")
    strata = ""
    if args.question_type_key:
        counts = {t: len(idx) for t, idx in group_by_type(sample, args.question_type_key).items()}
        strata = "; by {}: {}".format(args.question_type_key, ", ".join(
            f"{'(none)' if t is None else t} {c}"
            for t, c in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))))
    print(f"wrote {len(sample)} items to {args.out} ({'JSON list' if layout == 'json' else 'JSON lines'}){strata}")
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

    p = sub.add_parser("demo", help="SFT then GRPO on synthetic chest X-rays with a tiny Qwen2.5-VL, on CPU "
                                    "(--guided: GRPO vs Guided-GRPO on arithmetic with a tiny Qwen2)")
    p.add_argument("--out", help="run directory (default runs/demo; with --guided runs/demo-guided)")
    p.add_argument("--quick", action="store_true", help="a much shorter run, for smoke tests")
    p.add_argument("--compare", action="store_true",
                   help="train SFT+GRPO, SFT+Dr.GRPO and SFT+EditGRPO from the same SFT model and compare them")
    p.add_argument("--guided", action="store_true",
                   help="Guided-GRPO's demo: synthetic arithmetic word problems, SFT, then GRPO and Guided-GRPO "
                        "(rule verifier, at most 3 turns) from the same SFT model, compared on held-out problems")
    p.add_argument("--flow", action="store_true",
                   help="Flow-GRPO-Fast on a tiny SD3 transformer drawing coloured squares (needs grouprl[diffusion]): "
                        "pretrain, then RL against a rule reward, compared on held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, metavar="K",
                   help="with --compare: run the comparison for seeds seed..seed+K-1 (each its own data, SFT and RL "
                        "runs, in <out>/seed_<s>/; finished seeds are reused) and report means with 95%% t-intervals "
                        "and whether EditGRPO > Dr.GRPO > GRPO holds beyond the noise (default out runs/demo-compare)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("generate", help="write {id, response, answer} JSON lines from a model and a test set")
    p.add_argument("--model", required=True, help="model directory (or hub id)")
    p.add_argument("--data", required=True, help="test set (JSON, JSONL, parquet or a saved HF dataset)")
    p.add_argument("--out", required=True, help="output .jsonl file (what grouprl eval reads)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:i]")
    p.add_argument("--max-samples", type=int, help="only the first N samples")
    p.add_argument("--max-prompt-length", type=int, help="fail on (or truncate) longer prompts")
    p.add_argument("--format", default="auto", choices=["auto", "easyr1", "llava", "swift"])
    p.add_argument("--image-dir", help="base directory of relative image paths")
    p.add_argument("--system-prompt", help="system prompt added to every sample")
    p.add_argument("--id-key", default="id", help="record field written as each output's 'id' (default id)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--task", default="report", choices=["report", "classification", "grounding", "conversation"],
                   help="what grouprl eval --task will score (conversation also writes each record's 'history', "
                        "the turns before the answer; default report)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("eval", help="score {id, response, answer} records: per-sample CSV, summary with 95%% CIs")
    p.add_argument("--data", required=True, help="JSON list or JSON lines of {id, response, answer}")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--components", nargs="+",
                   help="report score components (default: the registered ones of EditGRPO's evaluation columns)")
    p.add_argument("--clean", action="store_true",
                   help="EditGRPO's cleaning: cut at 'Indication:', drop special tokens, take \\boxed{}")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs (0: none)")
    p.add_argument("--corpus-bootstrap", type=int, default=0,
                   help="bootstrap resamples for the corpus metrics' CIs (each recomputes the metric; default 0)")
    p.add_argument("--no-corpus", action="store_true", help="skip the corpus-level metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="report", choices=["report", "classification", "grounding", "conversation"],
                   help="RadVLM-GRPO's tasks: report (default; the report components), classification (findings-list "
                        "set F1), grounding (box IoU with an optimal matching), conversation (an LLM judge's score)")
    p.add_argument("--iou-threshold", type=float, default=0.5, help="grounding: IoU of a hit (default 0.5)")
    p.add_argument("--box-labels", default="auto", choices=["auto", "ignore"],
                   help="grounding: auto (default) matches only boxes of the same label when every box has one")
    p.add_argument("--judge-base-url", help="conversation: OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1 "
                                            "(default $GROUPRL_JUDGE_BASE_URL)")
    p.add_argument("--judge-model", help="conversation: the judge's model name (default $GROUPRL_JUDGE_MODEL)")
    p.add_argument("--judge-api-key-env", default="GROUPRL_JUDGE_API_KEY",
                   help="conversation: environment variable holding the judge's bearer key (default "
                        "GROUPRL_JUDGE_API_KEY; unset: no key sent)")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="conversation: seconds per judge request")
    p.add_argument("--judge-retries", type=int, default=3, help="conversation: retries of a failed judge request")
    p.add_argument("--judge-concurrency", type=int, default=4, help="conversation: judge requests in flight")
    p.add_argument("--judge-on-failure", default="raise", choices=["raise", "skip"],
                   help="conversation: raise (default) stops at a record the judge cannot score; skip leaves it "
                        "unscored (empty in per_sample.csv, listed in summary.json), never 0")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("sample", help="choose training items: CheXPO hard-sample mining or uniform, "
                                      "stratified by question type")
    p.add_argument("--data", required=True, help="items to choose from (JSON list or JSON lines)")
    p.add_argument("--out", required=True, help="output file, written in the input's layout")
    p.add_argument("--strategy", required=True, choices=["hard", "uniform"],
                   help="hard: the items the --predictions get wrong; uniform: all items")
    p.add_argument("--predictions", help="{id, response} JSON lines of the model to mine (what grouprl generate "
                                         "writes); needed by --strategy hard")
    p.add_argument("--n", type=int, help="how many items to write (default: every kept item)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--question-type-key", default="question_type",
                   help="field to stratify by; several joined by commas stratify by their combination; "
                        "'' samples without strata (default question_type)")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="an item is wrong when the answer-set F1 of its prediction is below this (default 1.0: "
                        "anything not exactly right)")
    p.add_argument("--answer-key", default="answer",
                   help="field of the reference answer (default answer; LLaVA and ms-swift records without it "
                        "use their final assistant turn)")
    p.add_argument("--id-key", default="id", help="field matching items to predictions' 'id' (default id)")
    p.set_defaults(fn=cmd_sample)

    p = sub.add_parser("serve", help="run a server")
    serve_sub = p.add_subparsers(dest="server", required=True)
    p = serve_sub.add_parser("rewards", help="the reward server (EditGRPO's /predict, /analyze, /extract; "
                                             "RadVLM-GRPO's /score_radcliq, /score_bertscore, /score_radgraph)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000, help="port (the first one with --ports)")
    p.add_argument("--ports", type=int, default=1,
                   help="listen on this many consecutive ports from --port, all served by the one server process "
                        "(RadVLM's layout: --port $WORKER_BASE_PORT --ports $((WORKER_NUM_GPUS * "
                        "WORKER_INSTANCES_PER_GPU)))")
    p.add_argument("--workers", type=int, default=1,
                   help="requests scored at once: 1 scores in the server process; N > 1 starts a pool of N scoring "
                        "processes at startup, and whichever is idle takes the next request from any connection "
                        "or port (set it to the cores the scoring may use)")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (default: $GROUPRL_REWARD_TOKEN)")
    p.add_argument("--components", nargs="+",
                   help="components scored when a request names none (default: EditGRPO's composite radgraphf1 "
                        "cxb14micro ratescore cxb_bal_acc_editgrpo format)")
    p.add_argument("--default-type", default="short", choices=["short", "cot", "free_form"],
                   help="report type of a request without 'type' (EditGRPO's server: short)")
    p.add_argument("--class-frequencies", metavar="JSON",
                   help="EditGRPO's class-frequency file for cxb_bal_acc_editgrpo (default: per pair)")
    p.add_argument("--entity-embeddings", default="auto", choices=["auto", "encoder", "ngram"],
                   help="/analyze entity embeddings: the sentence encoder (grouprl[metrics]), hashed character "
                        "n-grams, or auto (the encoder when installed)")
    p.add_argument("--entity-encoder", metavar="DIR", help="local encoder directory for --entity-embeddings encoder")
    p.add_argument("--max-batch", type=int, default=1024, help="most reports per request")
    p.add_argument("--max-chars", type=int, default=20000,
                   help="reports and references are scored up to this many characters; the rest is cut and the "
                        "answer lists the cut ones")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="largest request body (else 413)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive (else 408)")
    p.add_argument("--scoring-threads", type=int, default=1,
                   help="with --workers 1: threads scoring requests (the components must be thread-safe); each of "
                        "--workers N scoring processes scores one request at a time")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve_rewards)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad config or data file is one line on stderr and exit code 2, not a traceback."""
    from grouprl.config import ConfigError
    from grouprl.data.formats import DataError
    from grouprl.data.images import ImageError

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
    except (DataError, ImageError) as exc:  # the message names the file, the record and the field
        print(f"grouprl: data error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
