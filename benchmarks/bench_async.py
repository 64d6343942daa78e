"""The asynchronous loop modes against the synchronous one, in one run.

Trains the same tiny model on the same task with ``trainer.async_mode`` sync,
async_reward and one_step_off, each in its own subprocess, with a reward that waits
(like a reward server or an LLM judge) a fixed time per call plus a time per
completion, on top of its (cheap) work. Reports the median seconds per step over ``--repeats`` runs of each mode (in
alternating order; leaving out each run's first step, which starts up, and its last)
and each mode's speed-up over sync.

    python benchmarks/bench_async.py                                             # CPU, about a minute
    python benchmarks/bench_async.py --reward-call-latency 0 --reward-row-latency 0   # what overlap costs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("sync", "async_reward", "one_step_off")

REWARD = '''
import os
import time
import zlib

PER_CALL = float(os.environ["BENCH_REWARD_CALL_LATENCY"])
PER_ROW = float(os.environ["BENCH_REWARD_ROW_LATENCY"])


def slow_varied(prompts, completions, **kwargs):
    time.sleep(PER_CALL + PER_ROW * len(completions))  # a round trip to a reward server, say
    return [(zlib.crc32(c.encode()) % 7) / 6 for c in completions]
'''


def child(root: Path, mode: str, args) -> dict:
    from grouprl.config import load_config
    from grouprl.trainer.grpo import GRPOTrainer

    overrides = {
        "data.train_files": [str(root / "train.jsonl")], "data.max_response_length": args.tokens,
        "data.rollout_batch_size": args.prompts, "worker.actor.global_batch_size": args.prompts,
        "worker.actor.model.model_path": str(root / "model"), "worker.rollout.n": args.n,
        "worker.rollout.micro_batch_size": args.micro_batch,
        "worker.actor.micro_batch_size_per_device_for_update": args.prompts * args.n,
        "worker.reward.functions": [{"name": f"{root / 'reward.py'}:slow_varied"}],
        "trainer.max_steps": args.steps, "trainer.logger": [], "trainer.device": "cpu", "trainer.save_freq": 10_000,
        "trainer.log_rollouts": False, "trainer.output_dir": str(root / f"run_{mode}"), "trainer.async_mode": mode,
    }
    config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    trainer = GRPOTrainer(config)
    times = []
    original = trainer.step

    def timed(step):
        t0 = time.perf_counter()
        out = original(step)
        times.append(time.perf_counter() - t0)
        return out

    trainer.step = timed
    trainer.train()
    return {"step_seconds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per generation micro-batch")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--reward-call-latency", type=float, default=0.02, help="seconds each reward call waits")
    parser.add_argument("--reward-row-latency", type=float, default=0.01,
                        help="seconds each reward call waits per completion it scores")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, in alternating order")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print("RESULT " + json.dumps(child(Path(args._child[0]), args._child[1], args)))
        return

    from grouprl.models.tiny import build_tiny_text_lm

    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(16) for w in words]
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (root / "reward.py").write_text(REWARD)
        build_tiny_text_lm(root / "model", [r["problem"] for r in records] + words, seed=0, hidden_size=128,
                           layers=4)
        env = {**os.environ, "BENCH_REWARD_CALL_LATENCY": str(args.reward_call_latency),
               "BENCH_REWARD_ROW_LATENCY": str(args.reward_row_latency)}
        for repeat in range(args.repeats):
            # the order alternates, so that no mode always runs on a warmer (or busier) machine
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                cmd = [sys.executable, __file__, "--_child", str(root), mode, "--steps", str(args.steps),
                       "--prompts", str(args.prompts), "--n", str(args.n), "--micro-batch", str(args.micro_batch),
                       "--tokens", str(args.tokens)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    sys.exit(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
                run = json.loads(line[len("RESULT "):])
                results.setdefault(mode, {"runs": []})["runs"].append(run["step_seconds"])

    chunks = max(1, args.prompts * args.n // args.micro_batch)
    print(f"\n{args.steps} steps, {args.prompts} prompts x {args.n} samples x up to {args.tokens} tokens, "
          f"{chunks} generation micro-batches per step, reward latency {args.reward_call_latency} s per call "
          f"+ {args.reward_row_latency} s per completion\n")
    base = None
    print(f"{'mode':<14} {'median s/step':>14} {'vs sync':>8}")
    for mode in MODES:
        r = results[mode]
        # the first step starts everything up; one_step_off's last step has its batch ready and
        # nothing left to generate: the steps between are the steady state
        steady = sorted(t for run in r["runs"] for t in (run[1:-1] or run))
        r["step_seconds"] = r["runs"][0]
        median = steady[len(steady) // 2]
        base = base or median
        r["median_step_seconds"] = median
        print(f"{mode:<14} {median:>14.3f} {base / median:>7.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
