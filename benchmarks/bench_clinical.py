"""Speed of the clinical rewards on one core, and the reward server's latency under concurrent clients.

    python benchmarks/bench_clinical.py [--reports 2000] [--clients 8] [--refs 32] [--rollouts 5]
                                        [--requests 20] [--workers 1 2] [--baseline DIR ...] [--out FILE]

Two request shapes throughout:

- GRPO-shaped: ``--refs`` references x ``--rollouts`` responses each (32 x 5 = 160
  pairs), the responses variations of their reference as a policy writes them
  (sentences dropped, swapped for another report's, added, reordered; some verbatim,
  some repeating the previous response);
- all distinct: as many pairs, every hypothesis and reference a different report.

1. Scoring speed on one core (in-process, ``score_components``): the CheXpert-style
   labeler, the RadGraph-style entity F1 (``radgraphf1``) and EditGRPO's composite
   (radgraphf1 + cxb14micro + ratescore), on distinct reports and GRPO-shaped batches.
2. The reward server (``grouprl serve rewards``, uvicorn on 127.0.0.1) with each
   ``--workers`` count: p50 and p99 latency per request for ``--clients`` concurrent
   clients, each posting ``--requests`` batches to /predict, beside one client alone;
   and the server's CPU time per pair for grouprl's request (``editgrpo_keys: false``)
   and EditGRPO's (every key its client reads), as a ratio; how the clients'
   connections spread over the serving processes and their requests over the scoring
   processes (``X-Scoring-Pid``; a tree without that header scored where the connection
   landed), and how many cores the server kept busy (on a shared machine, what the
   other work left it). Every request carries a
   unique tag, so that no text repeats across requests (each GRPO step brings new
   responses) and per-text caches only help within a request.
3. Splitting one request across processes: the GRPO-shaped batch scored whole by one
   of two scoring processes (what the server's pool does), or cut in two halves (by
   reference group) scored by both at once; p50/p99 for one client and for ``--clients``.

``--baseline DIR`` (repeatable) measures other source trees (e.g. ``git archive HEAD |
tar -x -C DIR``) the same way in the same run, each measurement of them taken right
before this tree's, and prints them side by side (a column per tree, named after its
directory) with each column's ratio to the first. The timings of a shared machine are
noisy: compare figures of one run, not across runs.

The aims of issue 11 (item 3): p99 under 250 ms for 8 concurrent GRPO-shaped 160-pair
requests with ``--workers 2`` on 2 cores; each figure is printed beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

P99_AIM_MS = 250.0
# EditGRPO's composite as the in-process ``clinical`` reward sums it (the server's default adds
# cxb_bal_acc_editgrpo / 14 and the format term).
COMPOSITE = ["radgraphf1", "cxb14micro", "ratescore"]


# ----------------------------------------------------------------------------- request shapes
def reports(n: int, seed: int) -> list[str]:
    from grouprl.domains.radiology.synthetic.cxr import generate_studies

    # generate_studies renders images too; the reports alone are what is scored
    return [s.report for s in generate_studies(n, seed=seed, image_size=28)]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def vary(sentences: list[str], pool: list[str], rng: random.Random) -> str:
    """A response a policy might write for the report made of ``sentences``: most of it, with
    a sentence left out, another report's sentence in place of one or added, the order changed."""
    reference = " ".join(sentences)
    if rng.random() < 0.1:  # reproduces its reference
        return reference
    for _ in range(100):
        out = list(sentences)
        if len(out) > 1 and rng.random() < 0.5:
            del out[rng.randrange(len(out))]  # a finding missed
        if rng.random() < 0.4:
            out[rng.randrange(len(out))] = rng.choice(pool)  # a finding wrong
        if rng.random() < 0.3:
            out.insert(rng.randrange(len(out) + 1), rng.choice(pool))  # a finding invented
        if rng.random() < 0.2:
            rng.shuffle(out)
        text = " ".join(out)
        if text != reference:
            return text
    return reference


def grpo_pairs(refs: list[str], others: list[str], rollouts: int, seed: int) -> tuple[list[str], list[str]]:
    """(hyps, refs) of a GRPO batch: each reference ``rollouts`` times, with responses varying it
    (:func:`vary`; a tenth of them repeat the group's previous response, as sampling often does)."""
    rng = random.Random(seed)
    pool = [s for text in others for s in _SENTENCE_END.split(text) if s]
    hyps, out_refs = [], []
    for ref in refs:
        sentences = [s for s in _SENTENCE_END.split(ref) if s]
        for k in range(rollouts):
            hyps.append(hyps[-1] if k and rng.random() < 0.1 else vary(sentences, pool, rng))
            out_refs.append(ref)
    return hyps, out_refs


def shapes(n_refs: int, rollouts: int, seed: int) -> dict[str, tuple[list[str], list[str]]]:
    """The two request shapes, ``n_refs * rollouts`` pairs each."""
    n = n_refs * rollouts
    refs = reports(n_refs, seed=seed)
    return {"grpo": grpo_pairs(refs, reports(4 * n_refs, seed=seed + 1), rollouts, seed),
            "distinct": (reports(n, seed=seed + 2), reports(n, seed=seed + 3))}


def tagged(pairs: tuple[list[str], list[str]], tag: str) -> tuple[list[str], list[str]]:
    """The pairs with ``tag`` in front of every text: new texts, the same scores' work."""
    hyps, refs = pairs
    return [f"{tag} {h}" for h in hyps], [f"{tag} {r}" for r in refs]


# ----------------------------------------------------------------------------- 1. scoring speed
def clear_caches() -> None:
    """Per-text caches (graph extraction) would make a repeated run look faster than a fresh batch."""
    from grouprl.domains.radiology.rewards import entities, kg, ratescore

    for module in (entities, ratescore, kg):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def rate(fn: Callable[[], object], n: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        clear_caches()
        gc.collect()  # each repeat starts from the same garbage-collector state
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def scoring_speed(n: int, n_refs: int, rollouts: int) -> dict:
    from grouprl.domains.radiology.rewards import label_reports, score_components

    hyps, refs = reports(n, seed=1), reports(n, seed=2)
    # as many pairs as the distinct batch, in GRPO groups
    grpo_hyps, grpo_refs = grpo_pairs(refs[: max(1, n // rollouts)], hyps, rollouts, seed=5)
    return {
        "labeler_reports_per_s": rate(lambda: label_reports(hyps), n),
        "radgraphf1_pairs_per_s": rate(lambda: score_components(hyps, refs, ["radgraphf1"]), n),
        "composite_pairs_per_s": rate(lambda: score_components(hyps, refs, COMPOSITE), n),
        "composite_pairs_per_s_grpo": rate(lambda: score_components(grpo_hyps, grpo_refs, COMPOSITE),
                                           len(grpo_hyps)),
        "mean_words": statistics.mean(len(r.split()) for r in hyps),
    }


# ----------------------------------------------------------------------------- 2. the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
    return total


def source_tree(tree: str | None) -> str:
    """The directory holding the ``grouprl`` to measure: ``tree``, or the one this process imports."""
    if tree:
        return str(Path(tree).resolve())
    import grouprl

    return str(Path(grouprl.__file__).resolve().parents[1])


def env_for(tree: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Server:
    """``grouprl serve rewards`` in its own process (as users run it), from ``tree`` when given."""

    def __init__(self, workers: int, tree: str | None):
        tree = source_tree(tree)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # run from the tree: ``python -m`` puts the working directory first on the import path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grouprl", "serve", "rewards", "--port", str(self.port), "--workers", str(workers),
             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env_for(tree), cwd=tree)

    def __enter__(self) -> Server:
        import httpx

        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError(f"reward server did not start: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)

    def load(self, pairs: tuple[list[str], list[str]], clients: int, requests: int, editgrpo_keys: bool,
             run: str) -> dict:
        """``clients`` threads each posting ``requests`` tagged copies of ``pairs``: latency and CPU per pair."""
        import httpx

        latencies: list[float] = []
        pids: list = []  # the serving process each client's connection landed on
        scorers: list = []  # the process that scored each request
        lock = threading.Lock()
        n = len(pairs[0])

        def client(k: int) -> None:
            # one persistent connection per client, as a trainer's client keeps
            with httpx.Client(timeout=120) as http:
                pid = http.get(f"{self.url}/health").json().get("pid")
                with lock:
                    pids.append(pid)
                for i in range(requests):
                    hyps, refs = tagged(pairs, f"Exam {run}.{k}.{i}.")
                    # editgrpo_keys=False is what grouprl's client sends; EditGRPO's own client
                    # reads 11 more per-sample keys (more components computed per request)
                    body = {"hyps": hyps, "refs": refs, "type": "free_form", "editgrpo_keys": editgrpo_keys}
                    t0 = time.perf_counter()
                    r = http.post(f"{self.url}/predict", json=body)
                    elapsed = time.perf_counter() - t0
                    r.raise_for_status()
                    with lock:
                        latencies.append(elapsed)
                        # a tree whose answers do not name their scorer scored in the connection's process
                        scorers.append(r.headers.get("x-scoring-pid", pid))

        cpu0 = tree_cpu_seconds(self.proc.pid)
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        cpu = tree_cpu_seconds(self.proc.pid) - cpu0
        if len(latencies) != clients * requests:
            raise RuntimeError(f"{clients * requests - len(latencies)} request(s) failed")
        return {**percentiles(latencies), "pairs_per_s": len(latencies) * n / wall,
                "server_cpu_ms_per_pair": 1000 * cpu / (len(latencies) * n),
                # cores the server kept busy on average; on a shared machine, what it was left
                "server_cores_used": cpu / wall, "load_average_1min": os.getloadavg()[0],
                "clients_per_process": sorted((pids.count(p) for p in set(pids)), reverse=True),
                "requests_per_scoring_process": sorted((scorers.count(p) for p in set(scorers)), reverse=True)}


def percentiles(latencies: list[float]) -> dict:
    """p50 and p99 in ms (nearest-rank on the sorted sample: p99 of 160 requests is the 2nd slowest)."""
    s = sorted(latencies)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))] * 1000

    return {"requests": len(s), "p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": s[-1] * 1000}


def server_latency(shape_pairs: dict, workers: int, clients: int, requests: int, tree: str | None) -> dict:
    """Every load of section 2 against one server with ``workers`` processes."""
    out: dict = {}
    with Server(workers, tree) as server:
        server.load(shape_pairs["grpo"], 1, 2, True, "warm")  # imports, first-call costs
        for shape in ("grpo", "distinct"):
            out[f"{shape}_1_client"] = server.load(shape_pairs[shape], 1, requests, False, f"{shape}1")
            out[f"{shape}_{clients}_clients"] = server.load(shape_pairs[shape], clients, requests, False, f"{shape}n")
        out["grpo_1_client_editgrpo_keys"] = server.load(shape_pairs["grpo"], 1, requests, True, "e1")
        out[f"grpo_{clients}_clients_editgrpo_keys"] = server.load(shape_pairs["grpo"], clients, requests, True, "en")
    return out


# ----------------------------------------------------------------------------- 3. split across processes
def _score_part(hyps: list[str], refs: list[str]) -> dict[str, list[float]]:
    from grouprl.domains.radiology.rewards import score_components

    return score_components(hyps, refs, COMPOSITE)


def _split_by_reference(hyps: list[str], refs: list[str], parts: int) -> list[tuple[list[str], list[str]]]:
    """``parts`` slices of a batch, a reference's rows kept together (its parse is then done once)."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(refs):
        groups.setdefault(r, []).append(i)
    slices: list[list[int]] = [[] for _ in range(parts)]
    for rows in sorted(groups.values(), key=len, reverse=True):
        min(slices, key=len).extend(rows)
    return [([hyps[i] for i in rows], [refs[i] for i in rows]) for rows in slices if rows]


def split_latency(pairs: tuple[list[str], list[str]], clients: int, requests: int, processes: int = 2) -> dict:
    """Latency of requests scored whole by one of ``processes`` worker processes, or split across all."""
    import multiprocessing

    out: dict = {}
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        list(pool.map(_score_part, *zip(*[tagged(pairs, f"warm{k}") for k in range(processes)])))
        for mode in ("whole", "split"):
            for n_clients in (1, clients):
                latencies: list[float] = []
                lock = threading.Lock()

                def client(k: int, mode=mode, n_clients=n_clients, latencies=latencies, lock=lock) -> None:
                    for i in range(requests):
                        hyps, refs = tagged(pairs, f"Exam {mode}{n_clients}.{k}.{i}.")
                        t0 = time.perf_counter()
                        if mode == "whole":
                            pool.submit(_score_part, hyps, refs).result()
                        else:
                            futures = [pool.submit(_score_part, h, r)
                                       for h, r in _split_by_reference(hyps, refs, processes)]
                            for f in futures:
                                f.result()
                        with lock:
                            latencies.append(time.perf_counter() - t0)

                threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                out[f"{mode}_{n_clients}_client{'s' if n_clients > 1 else ''}"] = percentiles(latencies)
    return out


# ----------------------------------------------------------------------------- running and reporting
def scoring_in(tree: str | None, args: argparse.Namespace) -> dict:
    """Section 1 in a fresh process importing grouprl from ``tree`` (this tree when None)."""
    proc = subprocess.run([sys.executable, __file__, "--scoring-only", "--reports", str(args.reports),
                           "--refs", str(args.refs), "--rollouts", str(args.rollouts)],
                          env=env_for(source_tree(tree)), capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"scoring run for {tree or 'this tree'} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict:
    """Every section, for the baseline trees (when given) right before this one."""
    trees = {**{Path(tree).resolve().name: tree for tree in args.baseline}, "this": None}
    by_tree: dict = {name: {} for name in trees}
    for _ in range(2):  # alternate the trees, best of two: the load of a shared machine drifts
        for name, tree in trees.items():
            run = scoring_in(tree, args)
            best = by_tree[name].setdefault("scoring", run)
            for key, value in run.items():
                best[key] = max(best[key], value)
    shape_pairs = shapes(args.refs, args.rollouts, seed=3)
    for workers in args.workers:
        for name, tree in trees.items():
            by_tree[name][f"server_workers_{workers}"] = server_latency(shape_pairs, workers, args.clients,
                                                                        args.requests, tree)
    hyps, refs = shape_pairs["grpo"]
    return {
        "trees": by_tree,
        "grpo_shape": {"pairs": len(hyps), "distinct_refs": len(set(refs)), "distinct_hyps": len(set(hyps)),
                       "hyps_equal_to_their_ref": sum(h == r for h, r in zip(hyps, refs))},
        "split": None if args.no_split else split_latency(shape_pairs["grpo"], args.clients, args.requests),
    }


def report(results: dict, args: argparse.Namespace) -> list[str]:
    trees = results["trees"]
    names = list(trees)

    def row(label: str, values: list[float], unit: str, lower_is_better: bool = False, aim: float | None = None) -> str:
        cells = "".join(f"{v:10.1f}" for v in values)
        text = f"  {label:<44}{cells} {unit}"
        if len(values) > 1 and all(values):
            gains = [values[0] / v if lower_is_better else v / values[0] for v in values[1:]]
            text += "   " + " ".join(f"{g:.2f}x" for g in gains) + f" vs {names[0]}"
        if aim is not None:
            text += f"   (aim < {aim:.0f}: {'met' if values[-1] < aim else 'NOT met'})"
        return text

    lines = [f"{'':46}" + "".join(f"{n:>10}" for n in names)]
    scoring = [trees[n]["scoring"] for n in names]
    lines.append(f"one core, {args.reports} pairs ({scoring[-1]['mean_words']:.0f} words per report on average)")
    for key, label in (("labeler_reports_per_s", "labeler, reports/s"),
                       ("radgraphf1_pairs_per_s", "radgraphf1, pairs/s"),
                       ("composite_pairs_per_s", "composite, every text new, pairs/s"),
                       ("composite_pairs_per_s_grpo", f"composite, GRPO ({args.rollouts} per ref), pairs/s")):
        lines.append(row(label, [s[key] for s in scoring], ""))
    shape = results["grpo_shape"]
    lines.append(f"GRPO-shaped request: {shape['pairs']} pairs, {shape['distinct_refs']} references, "
                 f"{shape['distinct_hyps']} distinct responses ({shape['hyps_equal_to_their_ref']} equal to their "
                 "reference)")
    c = args.clients
    for workers in args.workers:
        lines.append(f"server, --workers {workers}, {args.requests} requests per client, latency in ms")
        server = [trees[n][f"server_workers_{workers}"] for n in names]
        for key, label in ((f"grpo_{c}_clients", f"GRPO-shaped, {c} clients"), ("grpo_1_client", "GRPO-shaped, 1 client"),
                           (f"distinct_{c}_clients", f"every text new, {c} clients"),
                           ("distinct_1_client", "every text new, 1 client"),
                           (f"grpo_{c}_clients_editgrpo_keys", f"GRPO-shaped, EditGRPO's keys, {c} clients")):
            for q in ("p50", "p99"):
                aim = P99_AIM_MS if q == "p99" and key == f"grpo_{c}_clients" else None
                lines.append(row(f"{label}: {q}", [s[key][f"{q}_ms"] for s in server], "ms", True, aim))
        cpu = {n: (trees[n][f"server_workers_{workers}"]["grpo_1_client"]["server_cpu_ms_per_pair"],
                   trees[n][f"server_workers_{workers}"]["grpo_1_client_editgrpo_keys"]["server_cpu_ms_per_pair"])
               for n in names}
        for n in names:
            loaded = trees[n][f"server_workers_{workers}"][f"grpo_{c}_clients"]
            lines.append(f"  {n}: GRPO-shaped load of {c} clients: connections per serving process "
                         f"{loaded['clients_per_process']}, requests per scoring process "
                         f"{loaded.get('requests_per_scoring_process')}, server busy on "
                         f"{loaded['server_cores_used']:.2f} cores on average, load average "
                         f"{loaded['load_average_1min']:.1f} at its end")
        lines.append(row("server CPU per pair, grouprl's request, us", [1000 * cpu[n][0] for n in names], "us", True))
        lines.append(row("server CPU per pair, EditGRPO's request, us", [1000 * cpu[n][1] for n in names], "us", True))
        # (CPU time is counted in clock ticks: a load too small to register shows n/a)
        lines.append("  EditGRPO's / grouprl's CPU per pair            " + "".join(
            f"{cpu[n][1] / cpu[n][0]:10.2f}" if cpu[n][0] else f"{'n/a':>10}" for n in names) + " x")
    split = results["split"]
    if split:
        lines.append("one GRPO-shaped request scored by 2 processes, whole or split in two (this tree), ms")
        for key in ("1_client", f"{c}_clients"):
            lines.append(f"  {key.replace('_', ' '):<12} whole p50 {split['whole_' + key]['p50_ms']:7.1f} "
                         f"p99 {split['whole_' + key]['p99_ms']:7.1f} | split p50 {split['split_' + key]['p50_ms']:7.1f}"
                         f" p99 {split['split_' + key]['p99_ms']:7.1f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=int, default=2000, help="pairs for the one-core scoring speed")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--refs", type=int, default=32, help="references per request")
    parser.add_argument("--rollouts", type=int, default=5, help="responses per reference")
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="the server's --workers (requests scored at once), one server per count")
    parser.add_argument("--baseline", action="append", default=[],
                        help="another source tree to measure the same way, for before/after figures (repeatable)")
    parser.add_argument("--no-split", action="store_true", help="skip section 3")
    parser.add_argument("--scoring-only", action="store_true", help=argparse.SUPPRESS)  # section 1, JSON on stdout
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    if args.scoring_only:
        print(json.dumps(scoring_speed(args.reports, args.refs, args.rollouts)))
        return 0
    for tree in args.baseline:
        if not Path(tree, "grouprl", "__init__.py").is_file():
            parser.error(f"--baseline {tree}: no grouprl package there")
    if len({Path(tree).resolve().name for tree in args.baseline} | {"this"}) != len(args.baseline) + 1:
        parser.error("--baseline directories need distinct names (other than 'this'): they name the columns")
    results = measure(args)
    print("\n".join(report(results, args)))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"settings": vars(args), **results, "load_average": os.getloadavg()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
