"""Shared test settings (no network, no hub) and the fixtures that many test files use.

Tiny models are built offline once per session for each set of arguments and only read by
the tests (a test that changes weights loads its own copy). Data sets are written from plain
records. A :class:`Task` is a tiny model with the data set it was built for, and writes a small
GRPO config for them; overrides are dotted keys, as on the command line.

This file imports no domain (``grouprl.domains``); a domain's shared fixtures live in
``tests/<domain>/conftest.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the "Say <word> <i>" task: prompts a tiny text model is built for, answered by the word
WORDS = ("yes", "no", "maybe", "left", "right", "up", "down")

# what the engine tests' tiny models are built from (their tokenizers learn these words)
ENGINE_CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
    "Right pneumothorax is present. No focal consolidation.",
    "No acute cardiopulmonary process. Lungs are clear.",
] * 4


# ---------------------------------------------------------------------------- plain helpers


def _set_dotted(values: dict, overrides: dict) -> dict:
    """Set each ``"a.b.c": value`` of ``overrides`` in the nested dict ``values`` (levels made as needed)."""
    for dotted, value in overrides.items():
        node = values
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return values


def _write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _say_records(repeats: int, words=WORDS) -> list[dict]:
    return [{"problem": f"Say {w} {i}", "answer": w} for i in range(repeats) for w in words]


@dataclass(frozen=True)
class Task:
    """A tiny model and the data file it was built for."""

    data: Path
    model: Path

    def config(self, out, rewards, **overrides) -> dict:
        """A GRPO config dict on this data and model: ``rewards`` (reward specs), output to ``out``,
        on the CPU, metrics as JSONL; then ``overrides`` (``"worker.rollout.n": 2``)."""
        values = {
            "data": {"train_files": [str(self.data)], "max_response_length": 6, "rollout_batch_size": 4},
            "worker": {"actor": {"model": {"model_path": str(self.model)}, "optim": {"lr": 1e-2}},
                       "rollout": {"n": 4},
                       "reward": {"functions": list(rewards)}},
            "trainer": {"output_dir": str(out), "max_steps": 2, "logger": ["jsonl"], "device": "cpu"},
        }
        return _set_dotted(values, overrides)


def _built_once(tmp_path_factory, name: str, build):
    """``build(out_dir, corpus, seed=, **options)``, called once per distinct arguments in a session."""
    built: dict[str, Path] = {}

    def get(corpus, *, seed: int = 0, **options) -> Path:
        key = repr((list(corpus), seed, sorted(options.items())))
        if key not in built:
            built[key] = build(tmp_path_factory.mktemp(name) / "model", list(corpus), seed=seed, **options)
        return built[key]

    return get


COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220)}
SHAPES = [(c, s) for s in ("left", "right") for c in COLOURS]
IMAGE_PROMPT = "Describe the picture."


def _image(index: int):
    """Picture ``index``: a coloured square on the left or the right of a grey field."""
    from PIL import Image, ImageDraw

    colour, side = SHAPES[index % len(SHAPES)]
    image = Image.new("RGB", (112, 112), (90, 90, 90))
    left = 8 if side == "left" else 60
    ImageDraw.Draw(image).rectangle([left, 28, left + 44, 72], fill=COLOURS[colour])
    return image


def _image_records(directory: Path, n: int, *, format: str) -> Path:
    """Write ``n`` pictures under ``directory/images/`` and a data set that asks about them: EasyR1
    (``data.jsonl``: problem / answer / images) or LLaVA (``data.json``: image / conversations).
    Image paths are relative to the data file."""
    (directory / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        relative = f"images/{i:03d}.png"
        _image(i).save(directory / relative)
        colour, side = SHAPES[i % len(SHAPES)]
        answer = f"A {colour} square on the {side}."
        if format == "llava":
            records.append({"id": f"pic{i}", "image": relative,
                            "conversations": [{"from": "human", "value": "<image>\n" + IMAGE_PROMPT},
                                              {"from": "gpt", "value": answer}]})
        else:
            records.append({"problem": "<image>" + IMAGE_PROMPT, "answer": answer, "images": [relative],
                            "id": f"pic{i}"})
    if format == "llava":
        path = directory / "data.json"
        path.write_text(json.dumps(records, indent=1))
        return path
    return _write_jsonl(directory / "data.jsonl", records)


def _image_corpus() -> list[str]:
    return [IMAGE_PROMPT] + [f"A {c} square on the {s}." for c, s in SHAPES]


# ---------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="session")
def tiny_text_lm(tmp_path_factory):
    """``tiny_text_lm(corpus, seed=0, **options)``: the directory of a tiny Qwen2 LM and its tokenizer
    (``grouprl.models.tiny.build_tiny_text_lm``), built once per session for each set of arguments."""
    from grouprl.models.tiny import build_tiny_text_lm

    return _built_once(tmp_path_factory, "tiny_lm", build_tiny_text_lm)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """``tiny_vlm(corpus, seed=0, **options)``: the directory of a tiny Qwen2.5-VL and its processor,
    built once per session for each set of arguments."""
    from grouprl.models.tiny import build_tiny_vlm

    return _built_once(tmp_path_factory, "tiny_vlm", build_tiny_vlm)


@pytest.fixture(scope="session")
def paths(tiny_vlm, tiny_text_lm):
    """The engine tests' tiny models, ``{"vlm": dir, "lm": dir}``, built from ENGINE_CORPUS (read only:
    tests/core/test_engine.py loads them as its ``vlm`` and ``lm`` fixtures)."""
    return {"vlm": tiny_vlm(ENGINE_CORPUS, seed=1), "lm": tiny_text_lm(ENGINE_CORPUS, seed=1)}


# ---------------------------------------------------------------------------- tasks: a model and its data


@pytest.fixture(scope="session")
def text_task(tmp_path_factory, tiny_text_lm):
    """``text_task(records, vocabulary=(), **model_options) -> Task``: ``records`` (problem / answer) as
    ``train.jsonl`` and a tiny text LM whose tokenizer learnt their problems and ``vocabulary``.
    Written and built once per session for each set of arguments."""
    made: dict[str, Task] = {}

    def make(records, vocabulary=(), **model_options) -> Task:
        key = repr((records, list(vocabulary), sorted(model_options.items())))
        if key not in made:
            data = _write_jsonl(tmp_path_factory.mktemp("text_task") / "train.jsonl", records)
            corpus = [r["problem"] for r in records] + list(vocabulary)
            made[key] = Task(data, tiny_text_lm(corpus, seed=0, **model_options))
        return made[key]

    return make


@pytest.fixture(scope="session")
def say_task(text_task):
    """``say_task(repeats, words=WORDS, **model_options) -> Task``: the prompts "Say <word> <i>" for i
    below ``repeats`` (answer: the word), and a tiny text LM for them."""

    def make(repeats: int, words=WORDS, **model_options) -> Task:
        return text_task(_say_records(repeats, words), list(words), **model_options)

    return make


@pytest.fixture(scope="session")
def image_task(tmp_path_factory, tiny_vlm):
    """``image_task(n, format="easyr1" | "llava") -> Task``: ``n`` pictures of coloured squares with a
    question and a reference answer each, and a tiny VLM whose tokenizer knows their words."""
    made: dict[tuple, Task] = {}

    def make(n: int, format: str = "easyr1") -> Task:
        if (n, format) not in made:
            data = _image_records(tmp_path_factory.mktemp("image_task"), n, format=format)
            made[n, format] = Task(data, tiny_vlm(_image_corpus(), seed=0))
        return made[n, format]

    return make


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="session")
def set_dotted():
    """``set_dotted(values, overrides)``: set each ``"a.b.c": value`` of ``overrides`` in the dict ``values``."""
    return _set_dotted


@pytest.fixture(scope="session")
def read_jsonl():
    """``read_jsonl(path)``: the records of a JSON-lines file (metrics.jsonl, rollouts.jsonl, ...)."""
    return _read_jsonl


@pytest.fixture(scope="session")
def interrupt_at_step():
    """``interrupt_at_step(trainer, step)``: train until ``step`` begins, where a KeyboardInterrupt
    stops the run as Ctrl-C would (steps before it done, and saved as the config says)."""

    def run(trainer, step: int) -> None:
        original = trainer.step

        def dying(current):
            if current == step:
                raise KeyboardInterrupt("killed")
            return original(current)

        trainer.step = dying
        with pytest.raises(KeyboardInterrupt):
            trainer.train()

    return run


class UpdateWatch:
    """Counts a trainer's optimizer steps as they begin, so that another thread can wait for one."""

    def __init__(self, trainer):
        import threading

        self.count = 0
        self._changed = threading.Condition()
        step = trainer.optimizer.step

        def noting_step(*args, **kwargs):
            with self._changed:
                self.count += 1
                self._changed.notify_all()
            return step(*args, **kwargs)

        trainer.optimizer.step = noting_step

    def wait_for(self, n: int, timeout: float) -> bool:
        """Whether the ``n``-th optimizer step began within ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= n, timeout)


@pytest.fixture(scope="session")
def watch_updates():
    """``watch_updates(trainer) -> UpdateWatch``: ``.count`` optimizer steps begun so far,
    ``.wait_for(n, timeout)`` blocks until the ``n``-th has begun (use before ``train()``)."""
    return UpdateWatch


@pytest.fixture(scope="session")
def torchrun():
    """``torchrun(*args, cwd=)``: ``torchrun --standalone --nproc_per_node 2 *args`` on the CPU (gloo),
    asserted to succeed; returns the completed process."""

    def run(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
        return proc

    return run


@pytest.fixture(scope="session")
def run_fresh():
    """``run_fresh(code)``: run ``code`` (dedented) in a new interpreter, where nothing is imported yet;
    its last line of output is one JSON value, which is returned."""
    import textwrap

    def run(code: str):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def serve_app():
    """``with serve_app(app, **uvicorn_options) as port:``: ``app`` served by uvicorn in a daemon thread
    on a free loopback port (the test is skipped without uvicorn), stopped at the end of the block."""
    import socket
    import threading
    import time
    from contextlib import contextmanager

    @contextmanager
    def serve(app, **options):
        uvicorn = pytest.importorskip("uvicorn")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        try:
            yield sock.getsockname()[1]
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()

    return serve


# ---------------------------------------------------------------------------- examples/


@dataclass(frozen=True)
class TinyExamples:
    """examples/ (``dir``), examples/tiny_setup.py (``setup``) and the directory its tiny stand-ins go to."""

    dir: Path
    root: Path
    setup: object

    def built(self, recipe: str | None = None) -> Path:
        """``root``, with the tiny data and model that ``recipe`` runs on built there (once): the flow
        recipes' or, for any other recipe or none, the language recipes'."""
        if recipe is not None and self.setup.is_flow(self.dir / recipe):
            self.setup.build_flow(self.root)
        else:
            self.setup.build(self.root)
        return self.root

    def run_one_step(self, recipe: str, out: Path) -> dict:
        """``grouprl train`` on the recipe with the overrides examples/run_tiny.sh uses, for one step;
        returns the step's metrics."""
        from grouprl.cli import main

        overrides = self.setup.overrides(self.dir / recipe, self.built(recipe), out)
        assert main(["train", str(self.dir / recipe), *overrides, "trainer.max_steps=1"]) == 0
        metrics = _read_jsonl(out / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1]
        return metrics[0]


@pytest.fixture(scope="session")
def tiny_examples(tmp_path_factory):
    """The recipes of examples/ and the tiny stand-ins they run on (built when first asked for)."""
    spec = importlib.util.spec_from_file_location("tiny_setup", ROOT / "examples" / "tiny_setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    return TinyExamples(ROOT / "examples", tmp_path_factory.mktemp("tiny"), setup)


@pytest.fixture(scope="session")
def check_lazy_exports():
    return _check_lazy_exports


def _check_lazy_exports(package_name: str) -> None:
    """A domain package's ``__all__`` names each resolve to an object of that domain, an unknown name is
    an AttributeError, and importing the package alone imports none of its modules (they load on first use)."""
    import importlib
    import subprocess
    import sys

    package = importlib.import_module(package_name)
    assert package.__all__
    for name in package.__all__:
        obj = getattr(package, name)
        assert getattr(obj, "__name__", name) == name
        assert obj.__module__.startswith(package_name)
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        package.not_exported
    code = f"import sys, {package_name}; print(sorted(m for m in sys.modules if m.startswith({package_name + '.'!r})))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


@pytest.fixture
def demo_process():
    """``run(driver, out, interrupt=None)``: a demo driver (Python source that patches a demo's sizes
    and hooks, then calls ``grouprl.cli.main`` with ``sys.argv[1]`` as the run directory) run in a
    process of its own, with ``INTERRUPT`` set to ``interrupt`` when given (where the driver sends
    itself a real SIGINT). SIGINT is put back to its default in the child: a background job inherits
    it ignored (see test_signals.default_sigint)."""
    import signal

    root = Path(__file__).resolve().parents[1]

    def run(driver: str, out: Path, interrupt: str | None = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "INTERRUPT"}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        if interrupt:
            env["INTERRUPT"] = interrupt
        return subprocess.run([sys.executable, "-c", driver, str(out)], capture_output=True, text=True, env=env,
                              timeout=900, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    return run


# ---------------------------------------------------------------------------- a real browser (run reports)


class Browser:
    """Headless Chromium driven by selenium through Debian's chromedriver: ``open(path)`` loads an HTML
    file from disk (file://) and returns the console's error entries; ``run(js)`` returns a script's value."""

    def __init__(self, driver):
        self.driver = driver

    def open(self, path: Path) -> list[dict]:
        self.driver.get_log("browser")  # what an earlier page left
        self.driver.get(Path(path).resolve().as_uri())
        # plotly draws in the load handlers; a script that throws is in the log by now
        self.driver.execute_async_script("const done = arguments[0]; requestAnimationFrame(() => setTimeout(done, 0));")
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def run(self, js: str, *args):
        return self.driver.execute_script(js, *args)


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """A :class:`Browser` (headless Chromium, no network); the test is skipped when there is no Chromium,
    except under CI (CI=true), where that fails: .ci/run installs it."""
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI needs chromium and chromedriver (.ci/run installs Debian's chromium chromium-driver)")
        pytest.skip("no chromium / chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver") if os.environ.get("CI") != "true" else \
        importlib.import_module("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    from grouprl.report.screenshot import CHROMIUM_FLAGS

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}")
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    driver.set_page_load_timeout(120)
    driver.set_script_timeout(60)
    try:
        yield Browser(driver)
    finally:
        driver.quit()
