"""The radiology domain's commands and demos, registered by name by its plugin.

- `grouprl generate`: a model's responses to a test set, as the {id, response, answer}
  records `grouprl eval` reads;
- `grouprl eval`: report scores (EditGRPO's evaluation columns) or RadVLM-GRPO's task
  metrics of such records, per sample and with bootstrap intervals;
- `grouprl sample`: CheXPO's hard-sample mining (or uniform), stratified by question type;
- `grouprl serve rewards`: the reward server (EditGRPO's and RadVLM-GRPO's protocols);
- the report demos: `grouprl demo` (the default: SFT then GRPO on synthetic chest X-rays)
  and `grouprl demo --compare [--seeds K]` (GRPO, Dr. GRPO and EditGRPO from one SFT model).

Only argparse is imported here; each command imports its machinery when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from grouprl.cli import Command, Demo, UsageError, demo_dir
from grouprl.data.formats import FORMATS


# ----------------------------------------------------------------------------- generate


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


def _generate_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    p.add_argument("--image-dir", help="base directory of relative image paths")
    p.add_argument("--system-prompt", help="system prompt added to every sample")
    p.add_argument("--id-key", default="id", help="record field written as each output's 'id' (default id)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--task", default="report", choices=["report", "classification", "grounding", "conversation"],
                   help="what grouprl eval --task will score (conversation also writes each record's 'history', "
                        "the turns before the answer; default report)")


GENERATE = Command("write {id, response, answer} JSON lines from a model and a test set", cmd_generate,
                   _generate_arguments)


# ----------------------------------------------------------------------------- eval


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


def _eval_arguments(p: argparse.ArgumentParser) -> None:
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


EVAL = Command("score {id, response, answer} records: per-sample CSV, summary with 95%% CIs", cmd_eval,
               _eval_arguments)


# ----------------------------------------------------------------------------- sample


def cmd_sample(args) -> int:
    from grouprl.domains.radiology.sample_selection import (SamplingError, candidate_indices, group_by_type,
                                                            read_records, stratified_sample, write_records)

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


def _sample_arguments(p: argparse.ArgumentParser) -> None:
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


SAMPLE = Command("choose training items: CheXPO hard-sample mining or uniform, stratified by question type",
                 cmd_sample, _sample_arguments)


# ----------------------------------------------------------------------------- serve rewards


def cmd_serve_rewards(args) -> int:
    from grouprl.domains.radiology.server.app import DEFAULT_COMPONENTS, serve
    from grouprl.errors import MissingExtra

    token = args.token if args.token is not None else os.environ.get("GROUPRL_REWARD_TOKEN") or None
    try:
        serve(args.host, args.port, args.workers, token, ports=args.ports,
              default_components=_names(args.components) or list(DEFAULT_COMPONENTS), max_batch=args.max_batch,
              max_chars=args.max_chars, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
              header_timeout=args.header_timeout,
              default_type=args.default_type, scoring_threads=args.scoring_threads,
              class_frequencies=args.class_frequencies, entity_embeddings=args.entity_embeddings,
              entity_encoder=args.entity_encoder, log_level=args.log_level)
    except MissingExtra:  # `grouprl` reports it (with the extra to install), or its traceback under --debug
        raise
    except (ValueError, OSError, ImportError) as exc:  # bad settings, missing files or packages, a busy port
        print(f"grouprl serve rewards: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve_rewards_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a request's line and headers may take to arrive, from the connection's opening "
                        "or the request's first byte (else 408 and the connection is closed)")
    p.add_argument("--scoring-threads", type=int, default=1,
                   help="with --workers 1: threads scoring requests (the components must be thread-safe); each of "
                        "--workers N scoring processes scores one request at a time")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


SERVE_REWARDS = Command("the reward server (EditGRPO's /predict, /analyze, /extract; "
                        "RadVLM-GRPO's /score_radcliq, /score_bertscore, /score_radgraph)",
                        cmd_serve_rewards, _serve_rewards_arguments)


# ----------------------------------------------------------------------------- demos


def run_compare_demo(out: str | None = None, *, quick: bool = False, seed: int = 0, seeds: int | None = None):
    """`grouprl demo --compare`: GRPO, Dr. GRPO and EditGRPO from the same SFT model (in ``out``,
    default runs/demo); with ``seeds`` K, that comparison for K seeds with 95% t-intervals
    (default runs/demo-compare). K and the seed directories are checked before anything runs."""
    from grouprl.domains.radiology.demo import check_seed_dirs, run_compare_seeds, run_demo

    if seeds is None:
        return run_demo(out, quick=quick, seed=seed, compare=True)
    out = demo_dir(out, "runs/demo-compare", quick)
    try:  # K >= 1, and no seed directory holds another run's results
        check_seed_dirs(out, seeds=seeds, seed=seed, quick=quick)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return run_compare_seeds(out, seeds=seeds, seed=seed, quick=quick)


DISTILL_DEMO = Demo(
    run="grouprl.domains.radiology.demo:run_distill_demo", flag="--distill",
    help="distil the tiny report model on-policy from the demo's SFT+GRPO model (run first when --out lacks "
         "it), for GRPO's steps, and compare SFT, SFT+GRPO and SFT+distill (default out runs/demo)")
REPORT_DEMO = Demo(
    run="grouprl.domains.radiology.demo:run_demo", default=True,
    help="SFT then GRPO on synthetic chest X-rays with a tiny Qwen2.5-VL, on CPU (default out runs/demo)")
COMPARE_DEMO = Demo(
    run=run_compare_demo, flag="--compare",
    help="train SFT+GRPO, SFT+Dr.GRPO and SFT+EditGRPO from the same SFT model and compare them",
    options=(("--seeds", dict(
        type=int, metavar="K",
        help="with --compare: run the comparison for seeds seed..seed+K-1 (each its own data, SFT and RL "
             "runs, in <out>/seed_<s>/; finished seeds are reused) and report means with 95%% t-intervals "
             "and whether EditGRPO > Dr.GRPO > GRPO holds beyond the noise (default out runs/demo-compare)")),))
