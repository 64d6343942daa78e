"""The radiology tests' shared fixtures: synthetic chest X-ray studies and a tiny VLM that knows their words.

The core fixtures (tiny model builders, tasks, run helpers) come from tests/conftest.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cxr_vlm(tiny_vlm):
    """A tiny Qwen2.5-VL whose tokenizer learnt every sentence a synthetic report can contain."""
    from grouprl.domains.radiology.synthetic.cxr import corpus

    return tiny_vlm(corpus(), seed=0)


@pytest.fixture(scope="session")
def cxr_data(tmp_path_factory):
    """``cxr_data(n, seed=, format="llava" | "easyr1")``: the path of a data set of ``n`` synthetic studies
    (``grouprl.domains.radiology.synthetic.cxr.write_dataset``), written once per session for each."""
    from grouprl.domains.radiology.synthetic.cxr import write_dataset

    written = {}

    def get(n: int, *, seed: int, format: str):
        if (n, seed, format) not in written:
            written[n, seed, format] = write_dataset(tmp_path_factory.mktemp("cxr") / "data", n, seed=seed,
                                                     format=format)
        return written[n, seed, format]

    return get



@pytest.fixture(scope="session")
def demo_plumbing_sizes():
    """The radiology demo's plumbing (seeds, variants, resume) at the smallest sizes that still draw a
    curve: the --quick sizes are for people, and test_report_demo runs them once."""
    return dict(train=96, val=16, sft_epochs=1, grpo_steps=5, n=4, prompts_per_step=8)


@pytest.fixture
def plumbing_sizes(monkeypatch, demo_plumbing_sizes):
    """`grouprl demo --quick` at ``demo_plumbing_sizes`` for one test."""
    from grouprl.domains.radiology import demo

    monkeypatch.setattr(demo, "QUICK", demo_plumbing_sizes)
