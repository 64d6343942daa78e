"""The run report of a flow run, in a real browser: the validation image grid (prompts and rewards
in its captions) by step, and the rollouts' prompts with each image's reward and advantage."""

from __future__ import annotations

from grouprl.domains.diffusion.trainer import FlowGRPOTrainer
from grouprl.report import write_report


def test_flow_run_report_shows_its_image_grid_and_rollouts(flow_config, tmp_path, browser, read_jsonl):
    run = tmp_path / "run"
    FlowGRPOTrainer(flow_config(run, **{"worker.rollout.val_images_to_log": 2, "trainer.max_steps": 1,
                                        "trainer.val_freq": 1, "trainer.save_freq": -1})).train()
    page = write_report(run)
    assert browser.open(page) == []
    grids = browser.run("return [...document.querySelectorAll('#validation-steps img.grid')]"
                        ".map(i => [i.closest('.step').dataset.step, i.naturalWidth])")
    assert grids == [["1", grids[0][1]]] and grids[0][1] > 0
    rows = read_jsonl(run / "rollouts.jsonl")
    prompts = browser.run("return [...document.querySelectorAll(\"#rollout-steps .step[data-step='1'] .prompt pre\")]"
                          ".map(p => p.textContent)")
    assert prompts == list(dict.fromkeys(r["prompt"] for r in rows if r["step"] == 1))
    advantages = browser.run("return [...document.querySelectorAll(\"#rollout-steps .step[data-step='1'] "
                             "table.completions tr\")].filter(r => r.cells[0].tagName === 'TD')"
                             ".map(r => r.cells[r.cells.length - 2].textContent)")
    assert advantages == [f"{r['advantage']:.4g}" for r in rows if r["step"] == 1]
    # the flow run's curves are drawn as the language runs' are
    assert browser.run("return document.querySelectorAll(\"[data-group='reward'] .scatterlayer path.js-line\").length") > 0
