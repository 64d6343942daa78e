"""`grouprl plan`: each predicted part of a step's memory against the live tensor bytes of a real run.

One GRPO step of a tiny Qwen2 through the trainer (bf16 compute over fp32 masters, KL on: every
copy of the weights exists) gives the weights, AdamW state, gradients, reference and rollout copy;
real log-prob forwards of the same model (grouprl's ``forward_response_log_probs``, the update's
forward) under ``LiveTensors`` give the activations with and without checkpointing, padded and
padding-free, and the log-prob chunk's peak. Each part must be within 15% of what was measured.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from grouprl.config import config_from_dict
from grouprl.planning import memory
from grouprl.planning.live_bytes import storage_bytes
from grouprl.planning.model_shape import model_shape
from grouprl.planning.plan import plan_memory, settings_from_config

TOLERANCE = 0.15


def close(predicted: int, measured: int) -> bool:
    return measured > 0 and abs(predicted - measured) <= TOLERANCE * measured


@pytest.fixture(scope="module")
def run(say_task, tmp_path_factory):
    """One step of a mixed-precision run with KL, and the live bytes of each part (grads at the optimizer step)."""
    from grouprl.trainer.grpo import GRPOTrainer

    task = say_task(4)
    values = task.config(tmp_path_factory.mktemp("plan_run"), [{"name": "length", "kwargs": {"target": 4}}], **{
        "worker.actor.model.dtype": "bfloat16", "algorithm.kl_coef": 0.01, "trainer.max_steps": 1,
        "trainer.log_rollouts": False, "worker.actor.global_batch_size": 4})
    config = config_from_dict(values)
    trainer = GRPOTrainer(config)
    grads = []
    step = trainer.optimizer.step

    def measuring_step(*args, **kwargs):
        grads.append(storage_bytes(p.grad for p in trainer.policy.parameters() if p.grad is not None))
        return step(*args, **kwargs)

    trainer.optimizer.step = measuring_step
    trainer.step(1)
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    measured = {"weights": storage_bytes(trainer.policy.parameters()), "optimizer_state": storage_bytes(states),
                "gradients": max(grads), "reference": storage_bytes(trainer.ref_model.model.parameters()),
                "rollout_copy": storage_bytes(trainer.engine.model.parameters())}
    shape = model_shape(str(task.model))
    plan = plan_memory(shape, settings_from_config(config), None)
    return {"task": task, "shape": shape, "plan": plan, "measured": measured, "config": config}


@pytest.mark.parametrize("part", ["weights", "optimizer_state", "gradients", "reference", "rollout_copy"])
def test_weight_parts_match_the_live_tensors_of_a_trainer_step(run, part):
    """fp32 masters, fp32 AdamW moments, fp32 gradients, the bf16 reference and the bf16 rollout copy."""
    predicted, measured = run["plan"].parts[part], run["measured"][part]
    assert close(predicted, measured), (part, predicted, measured)


def test_without_kl_or_with_lora_there_is_no_reference_and_lora_trains_the_adapters(run):
    from grouprl.models.loading import apply_lora, load_model_and_processor

    config = run["config"]
    no_kl = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, kl_coef=0.0))
    assert plan_memory(run["shape"], settings_from_config(no_kl), None).parts["reference"] == 0
    lora = model_shape(str(run["task"].model), lora_rank=8)
    model, _, _ = load_model_and_processor(run["task"].model)
    live = apply_lora(model, rank=8, alpha=16)
    adapters = sum(p.numel() for n, p in live.named_parameters() if "lora_" in n)
    assert lora.trained_parameters == lora.adapter_parameters == adapters > 0


@pytest.fixture(scope="module")
def lm(tiny_text_lm):
    """A tiny Qwen2 with a real model's proportions (MLP 5.5 x hidden, 7 query heads per key head) and its shape."""
    path = tiny_text_lm(["say yes no maybe"], hidden_size=112, heads=14, kv_heads=2, intermediate_size=616)
    return {"path": path, "shape": model_shape(str(path))}


def _forward_live_bytes(path, *, checkpointing: bool, **forward) -> int:
    from grouprl.models.loading import load_model_and_processor
    from grouprl.planning.live_bytes import update_forward_bytes

    model, _, _ = load_model_and_processor(path, gradient_checkpointing=checkpointing)
    return update_forward_bytes(model.train(), **forward)


@pytest.mark.parametrize("mixed, checkpointing, padding_free", [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False), (False, False, True),
    (True, False, True)],
    ids=["fp32", "mixed", "fp32-checkpointing", "mixed-checkpointing", "fp32-padding-free", "mixed-padding-free"])
def test_activations_match_what_a_real_update_forward_keeps(run, lm, mixed, checkpointing, padding_free):
    rows, prompt, response, chunk = 8, 40, 88, 16
    measured = _forward_live_bytes(lm["path"], rows=rows, prompt=prompt, response=response, mixed=mixed,
                                   checkpointing=checkpointing, padding_free=padding_free, chunk_tokens=chunk)
    settings = dataclasses.replace(
        settings_from_config(run["config"]), dtype="bfloat16" if mixed else "float32", checkpointing=checkpointing,
        padding_free=padding_free, micro_batch_update=rows, prompt_length=prompt, response_length=response,
        chunk_tokens=chunk)
    parts = plan_memory(lm["shape"], settings, None).parts
    # chunks of 16 of the 704 response positions are checkpointed: no logits are kept
    assert parts["logprob_chunk"] == memory.logprob_chunk_bytes(rows * response, lm["shape"].vocab, chunk,
                                                                compute_bytes=2 if mixed else 4)
    # autocast's bf16 copies of the weights live exactly as long as the activations: measured with them
    predicted = parts["activations"] + parts["autocast_weight_copies"]
    assert (parts["autocast_weight_copies"] > 0) == mixed
    assert close(predicted, measured), (predicted, measured)


@pytest.mark.parametrize("backward, with_entropy, mixed", [(True, True, False), (False, False, False),
                                                           (False, False, True)],
                         ids=["update", "experience", "experience-mixed"])
def test_logprob_chunk_peak_matches_the_live_peak(backward, with_entropy, mixed):
    """The output layer's logits, ``chunk`` positions at a time (grouprl's ``score_positions``)."""
    from grouprl.planning.live_bytes import logprob_chunk_peak

    positions, hidden, vocab, chunk = 96, 16, 4096, 32
    measured = logprob_chunk_peak(positions=positions, hidden=hidden, vocab=vocab, chunk_tokens=chunk,
                                  backward=backward, with_entropy=with_entropy, mixed=mixed)
    predicted = memory.logprob_chunk_bytes(positions, vocab, chunk, compute_bytes=2 if mixed else 4,
                                           with_entropy=with_entropy, backward=backward)
    assert close(predicted, measured), (predicted, measured)


@pytest.mark.parametrize("max_pixels", [56 * 56, 200 * 200, None])
def test_image_tokens_are_the_model_processors_count(tiny_vlm, max_pixels):
    """The plan's image tokens equal what the processor writes for the largest image grouprl lets through."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from grouprl.data.images import resize_to_pixel_range
    from grouprl.planning.model_shape import image_tokens_per_image

    path = tiny_vlm(["Describe the picture."], seed=0)
    side = math.isqrt(max_pixels) if max_pixels else 1000
    image = resize_to_pixel_range(Image.new("RGB", (side, side)), max_pixels=max_pixels)
    processor = AutoImageProcessor.from_pretrained(path)
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
    written = int(grid.prod()) // processor.merge_size ** 2
    assert image_tokens_per_image(str(path), max_pixels=max_pixels) == written > 0
    assert model_shape(str(path)).is_vlm


# ----------------------------------------------------------------------------- the command


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    """``grouprl plan ...`` in this process: (exit code, stdout, stderr)."""
    from grouprl.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_documented_keys_and_its_suggestions_are_replans(run, tmp_path):
    from grouprl.planning.command import build_plan

    config = run["config"]
    result = build_plan(config, gpus=1, gpu_memory=1)  # 1 byte: nothing fits, so the suggestions come
    for key in ("model", "gpus", "gpu_memory_bytes", "parts", "phases", "phase_totals", "peak_bytes", "peak_phase",
                "fits", "tokens_per_step", "images_per_step", "image_tokens_per_image", "kv_cache", "suggestions",
                "notes"):
        assert key in result, key
    assert result["fits"] is False and result["peak_bytes"] == max(result["phase_totals"].values())
    json.dumps(result)
    by_change = {s["change"]: s for s in result["suggestions"]}
    # the checkpointing figure is the plan of the config with that override, not a percentage
    changed = dataclasses.replace(config, worker=dataclasses.replace(config.worker, actor=dataclasses.replace(
        config.worker.actor, model=dataclasses.replace(config.worker.actor.model,
                                                       enable_gradient_checkpointing=True))))
    assert by_change["gradient checkpointing"]["peak_bytes"] == build_plan(changed, gpus=1, gpu_memory=None)[
        "peak_bytes"]
    assert set(by_change) >= {"gradient checkpointing", "offload parameters and optimizer state", "LoRA rank 64"}
    fsdp = [s for s in result["suggestions"] if s["change"].startswith("FSDP")]
    assert fsdp and fsdp[0]["peak_bytes"] < result["peak_bytes"]


def test_every_suggestion_is_a_config_grouprl_accepts(run):
    """A suggestion's overrides load on top of the run's config (offload comes with the fsdp strategy it needs,
    LoRA without it), and the combined one too."""
    from grouprl.config.load import load_config, to_dict
    from grouprl.planning.command import build_plan

    config = run["config"]
    peak = build_plan(config, gpus=1, gpu_memory=None)["peak_bytes"]
    for gpu_memory in (1, peak - 1):  # nothing fits alone (the combined suggestion comes), or some do
        result = build_plan(config, gpus=1, gpu_memory=gpu_memory)
        assert result["suggestions"]
        for suggestion in result["suggestions"]:
            overrides = [o for o in suggestion["overrides"] if not o.startswith("--")]
            load_config(None, overrides, base=to_dict(config))
    with_offload = {s["change"]: s["overrides"] for s in build_plan(config, gpus=1, gpu_memory=1)["suggestions"]}
    assert with_offload["offload parameters and optimizer state"] == [
        "worker.actor.strategy=fsdp", "worker.actor.offload.offload_params=true"]


def test_plan_command_prints_the_table_and_json(run, capsys):
    model = f"worker.actor.model.model_path={run['task'].model}"
    code, out, err = _plan(capsys, model, "--gpu-memory", "80")
    assert code == 0, err
    assert "activations" in out and "fits" in out
    code, out, err = _plan(capsys, model, "--gpus", "2", "worker.actor.strategy=fsdp", "algorithm.kl_coef=0.01",
                           "--gpu-memory", "80", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["gpus"] == 2 and result["fits"] is True and result["settings"]["sharded"] is True
    # FSDP over 2: half the fp32 weights, gradients and AdamW state on each device; the frozen copies whole
    shape = run["shape"]
    assert result["parts"]["weights"] == math.ceil(shape.parameters / 2) * 4
    assert result["parts"]["optimizer_state"] == 2 * result["parts"]["gradients"] == 2 * result["parts"]["weights"]
    assert result["parts"]["reference"] == shape.parameters * 4  # float32 run: the reference in fp32


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be a positive number"),
    (["--gpus", "-2"], "--gpus must be a positive number"),
    (["--gpu-memory", "lots"], "--gpu-memory must be a positive number"),
    (["--gpu-memory", "0"], "--gpu-memory must be a positive number"),
])
def test_bad_flags_are_one_line_and_exit_2(run, capsys, argv, message):
    code, _, err = _plan(capsys, f"worker.actor.model.model_path={run['task'].model}", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_unresolvable_model_names_the_key(tmp_path, capsys):
    code, _, err = _plan(capsys, f"worker.actor.model.model_path={tmp_path / 'nowhere'}", "--gpu-memory", "80")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "worker.actor.model.model_path" in err and "nowhere" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _plan(capsys, f"worker.actor.model.model_path={tmp_path / 'empty'}")
    assert code == 2 and "worker.actor.model.model_path" in err and "config.json" in err, err


def test_a_colocated_vllm_share_that_does_not_fit_is_cut_to_what_the_step_needs(run):
    from grouprl.planning.command import build_plan

    config = run["config"]
    # short prompts: the generation phase, where vLLM's share sits, is the peak
    vllm = dataclasses.replace(config, data=dataclasses.replace(config.data, max_prompt_length=16),
                               worker=dataclasses.replace(config.worker, rollout=dataclasses.replace(
                                   config.worker.rollout, engine="vllm", gpu_memory_utilization=0.9)))
    at_rest = build_plan(vllm, gpus=1, gpu_memory=None)["phase_totals"]["generation"]  # no share without a size
    memory_size = 5 * at_rest
    result = build_plan(vllm, gpus=1, gpu_memory=memory_size)
    assert result["fits"] is False and result["parts"]["vllm"] == int(0.9 * memory_size)
    share = next(s for s in result["suggestions"] if s["change"].startswith("vLLM's share"))
    value = float(share["overrides"][0].split("=")[1])
    assert 0 < value < 0.9 and share["fits"] is True
    cut = dataclasses.replace(vllm, worker=dataclasses.replace(vllm.worker, rollout=dataclasses.replace(
        vllm.worker.rollout, gpu_memory_utilization=value)))
    assert share["peak_bytes"] == build_plan(cut, gpus=1, gpu_memory=memory_size)["peak_bytes"]


def test_a_dialogue_is_planned_with_its_whole_length(run):
    """Under multi-turn rollouts a response is the whole dialogue: max_turns turns and what comes between them."""
    from grouprl.config.load import load_config, to_dict
    from grouprl.rollout.multiturn import TEMPLATE_TOKENS_PER_TURN

    base = to_dict(run["config"])
    single = settings_from_config(run["config"])
    tools = load_config(None, ["worker.rollout.multi_turn.tools=[calculator]", "worker.rollout.multi_turn.max_turns=3",
                               "worker.rollout.multi_turn.max_observation_tokens=40"], base=base)
    # 3 turns of data.max_response_length, and 40 tokens between each two
    assert settings_from_config(tools).response_length == 3 * single.response_length + 2 * 40
    guided = load_config(None, ["worker.rollout.verifier.enable=true", "worker.rollout.verifier.backend=rule",
                                "worker.rollout.verifier.max_turns=2", "worker.rollout.verifier.max_tokens=10"],
                         base=base)
    assert settings_from_config(guided).response_length == 2 * single.response_length + 10 + TEMPLATE_TOKENS_PER_TURN
