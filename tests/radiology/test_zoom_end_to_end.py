"""The ``zoom`` tool end to end (issue 33, item 6): a GRPO step of a tiny Qwen2.5-VL on synthetic chest
X-ray studies with ``worker.rollout.multi_turn.environment: radiology_zoom``. The policy's first turn is
a forced call of ``zoom`` (a random tiny policy never writes one); the enlarged crop comes back as an
image in a ``tool`` message, the second turn is sampled from a context holding the film and the crop,
and the step trains on exactly that context."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from grouprl.config import config_from_dict
from grouprl.report import write_report
from grouprl.rollout.logprobs import forward_response_log_probs
from grouprl.trainer.grpo import GRPOTrainer

from scripted_turns import ScriptedFirstTurn  # tests/scripted_turns.py

REGION = "cardiac silhouette"
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"region": "%s"}}\n</tool_call>' % REGION


def image_runs(ids: torch.Tensor, image_id: int) -> int:
    """How many runs of consecutive image placeholder tokens ``ids`` holds: one per image in the context."""
    is_image = (ids == image_id).long()
    return int((is_image[1:] > is_image[:-1]).sum() + is_image[0])


@dataclass
class ZoomRun:
    run: Path
    trainer: GRPOTrainer
    scripted: ScriptedFirstTurn
    before: dict[str, torch.Tensor]  # the policy's weights before the step (those the rollout sampled with)


@pytest.fixture(scope="module")
def zoom_run(cxr_vlm, cxr_data, tmp_path_factory) -> ZoomRun:
    """One GRPO step of the tiny VLM on four synthetic studies, n=2, each dialogue opening with the zoom call."""
    run = tmp_path_factory.mktemp("zoom") / "run"
    config = config_from_dict({
        "data": {"train_files": [str(cxr_data(4, seed=0, format="easyr1"))], "max_response_length": 6,
                 "rollout_batch_size": 2},
        "worker": {"actor": {"model": {"model_path": str(cxr_vlm)}, "optim": {"lr": 1e-3}, "global_batch_size": 2},
                   "rollout": {"n": 2, "multi_turn": {"environment": "radiology_zoom", "max_turns": 2,
                                                      "tool_parser": "hermes"}},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 4}}]}},
        "trainer": {"output_dir": str(run), "max_steps": 1, "logger": ["jsonl"], "device": "cpu",
                    "val_freq": -1},
    })
    trainer = GRPOTrainer(config)
    trainer.engine = scripted = ScriptedFirstTurn(trainer.engine, trainer.processor, CALL)
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    return ZoomRun(run, trainer, scripted, before)


def test_a_zoom_call_returns_the_crop_to_the_policy_and_the_step_trains_on_it(zoom_run):
    run, trainer, scripted, before = zoom_run.run, zoom_run.trainer, zoom_run.scripted, zoom_run.before
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())

    batch = trainer.last_step.batch
    image_id = trainer.model.config.image_token_id
    first_turn = len(scripted.ids)
    contexts = scripted.calls[1]  # what each dialogue's second turn was generated from
    assert len(contexts) == len(batch) == 4
    for row, context in enumerate(contexts):
        # the film and the enlarged crop: two grids, two placeholder runs, in the ids the turn was sampled from
        assert context.model_inputs["image_grid_thw"].shape[0] == 2
        assert image_runs(context.ids, image_id) == 2
        # the row the step trained on holds both images, and its ids are that context followed by the turn
        inputs = batch.model_inputs[row]
        assert torch.equal(inputs["image_grid_thw"], context.model_inputs["image_grid_thw"])
        assert torch.equal(inputs["pixel_values"], context.model_inputs["pixel_values"])
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        turn, tool, second = batch.extras["spans"][row]  # [start, end, kind] in the response
        assert turn == [0, first_turn, "policy"] and tool[:1] == [first_turn] and second[::2] == [tool[1], "policy"]
        turn_start = second[0]
        assert torch.cat([prompt, batch.response_ids[row, :turn_start]]).tolist() == context.ids.tolist()
        assert batch.policy_mask[row, :first_turn].all() and not batch.policy_mask[row, first_turn:turn_start].any()

    # the log-probs the trainer scores for the second turn, on the whole dialogue in its padded batch, are those
    # of the turn computed from its context alone, as generation saw it (the weights the turn was sampled with)
    with torch.no_grad():
        for name, param in trainer.policy.named_parameters():
            param.copy_(before[name])
        scored = trainer._log_probs(trainer.model, batch)
        for row, context in enumerate(contexts):
            start, end, _ = batch.extras["spans"][row][2]
            turn = batch.response_ids[row, start:end]
            alone, _ = forward_response_log_probs(trainer.model, context.ids[None], torch.ones_like(context.ids)[None],
                                                  turn[None], torch.ones_like(turn)[None], context.model_inputs)
            torch.testing.assert_close(scored[row, start:end], alone[0], atol=1e-5, rtol=0)

    # rollouts.jsonl: the call, and the tool's answer with its one image
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4
    for record in rollouts:
        call, answer = record["dialogue"][:2]
        assert call["tool_calls"] == [{"type": "function", "function": {"name": "zoom",
                                                                         "arguments": {"region": REGION}}}]
        assert answer["role"] == "tool" and answer["tools"] == ["zoom"] and answer["images"] == 1
        assert f"The {REGION}, enlarged" in answer["text"]
        (result,) = answer["results"]
        assert result["name"] == "zoom" and result["images"] == 1 and result["text"].startswith(f"[image]The {REGION}")
        assert record["dialogue"][2]["role"] == "assistant"
        assert record["tool_calls"] == 1 and record["stop_reason"] == "stop"
    metrics = next(m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "tools/calls" in m)
    assert metrics["tools/zoom/calls"] == 4 and metrics["tools/errors"] == 0


def test_the_run_report_shows_the_zoom_call_and_its_image(browser, zoom_run):
    """The report of that run (rollouts.jsonl as the trainer wrote it): the call with its region, the result
    under the tool's name with its image counted, and the dialogue's tool-call count."""
    assert browser.open(write_report(zoom_run.run)) == []
    calls = browser.run("return [...document.querySelectorAll('.dialogue .call')].map(c => c.textContent)")
    assert calls == [f'zoom({{"region": "{REGION}"}})'] * 4
    results = browser.run("return [...document.querySelectorAll('.dialogue .turn.tool .result .tool-name')]"
                          ".map(r => r.textContent)")
    assert results == ["zoom (1 image)"] * 4
    summaries = browser.run("return [...document.querySelectorAll('.dialogue summary')].map(s => s.textContent)")
    assert summaries == ["dialogue: 3 turns, 1 tool call, stopped: stop"] * 4
