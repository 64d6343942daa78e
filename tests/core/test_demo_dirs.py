"""Each demo's default directory: a --quick run writes to its own (the full run's with -quick appended),
so that a smoke test never overwrites a full run's results. Each demo is stopped as soon as it has made
its directory (at its first seeding), so nothing trains."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from grouprl.cli import demo_dir, main


class Stopped(BaseException):
    """Raised at the demo's first torch.manual_seed, once its directory exists; nothing catches it."""


@pytest.mark.parametrize("words, full, quick", [
    ([], "runs/demo", "runs/demo-quick"),
    (["--compare"], "runs/demo", "runs/demo-quick"),
    (["--compare", "--seeds", "1"], "runs/demo-compare/seed_0", "runs/demo-compare-quick/seed_0"),
    (["--guided"], "runs/demo-guided", "runs/demo-guided-quick"),
    (["--guided", "--seeds", "1"], "runs/demo-guided/seed_0", "runs/demo-guided-quick/seed_0"),
    (["--flow"], "runs/demo-flow", "runs/demo-flow-quick"),
    (["--flow", "--compare"], "runs/demo-flow-compare", "runs/demo-flow-compare-quick"),
])
def test_a_quick_demo_writes_to_its_own_directory(tmp_path, monkeypatch, words, full, quick):
    if "--flow" in words:
        pytest.importorskip("diffusers")
    monkeypatch.chdir(tmp_path)

    def stop(seed):
        raise Stopped()

    monkeypatch.setattr(torch, "manual_seed", stop)
    for extra, made, other in (([], full, quick), (["--quick"], quick, full)):
        with pytest.raises(Stopped):
            main(["demo", *words, *extra])
        assert (tmp_path / made).is_dir() and not (tmp_path / other).exists(), (words, extra)
        shutil.rmtree(tmp_path / "runs")  # the next run starts from nothing


def test_out_wins_over_the_default(tmp_path):
    assert demo_dir(tmp_path / "x", "runs/demo", quick=True) == tmp_path / "x"
    assert demo_dir(None, "runs/demo", quick=True) == Path("runs/demo-quick")
    assert demo_dir(None, "runs/demo", quick=False) == Path("runs/demo")
