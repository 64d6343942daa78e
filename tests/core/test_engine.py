"""The transformers generation engine and response log-probs, on tiny offline models."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from grouprl.data.sample import Sample
from grouprl.models.loading import apply_lora, load_model_and_processor
from grouprl.models.inputs import collate_model_inputs, forward_kwargs
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.engine import RolloutEngine, SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs, forward_response_log_probs

EOS_PROBABILITY = 0.15  # per step, so that 8-token responses both end and run out


def with_eos_bias(model, eos_id, probability=EOS_PROBABILITY):
    """Give the random model a steady chance of ending its turn, so EOS handling is exercised.

    A freshly initialised model's next-token distribution is close to uniform,
    so a bias of log(p / (1 - p) * (V - 1)) on the EOS logit makes EOS come with
    probability about p at every step.
    """
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos_id] = math.log(probability / (1 - probability) * (head.out_features - 1))
    model.set_output_embeddings(biased)
    return model


def image(color, size=(112, 112)):
    return Image.new("RGB", size, color)


def samples():
    return [
        Sample(
            messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Findings?"}]}],
            images=[image((200, 30, 30))],
            index=0,
        ),
        Sample(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Current and prior:"},
                        {"type": "image"},
                        {"type": "image"},
                    ],
                }
            ],
            images=[image((20, 200, 30), (168, 112)), image((20, 30, 220))],
            index=1,
        ),
        Sample(messages=[{"role": "user", "content": [{"type": "text", "text": "Report without images."}]}], index=2),
    ]


def text_samples():
    return [
        Sample(messages=[{"role": "user", "content": "Heart size?"}], index=0),
        Sample(messages=[{"role": "user", "content": [{"type": "text", "text": "Is there effusion on the left?"}]}], index=1),
    ]


# `paths` (tests/conftest.py): the tiny VLM and LM, built once per session; each module loads its own copies


@pytest.fixture(scope="module")
def vlm(paths):
    model, processor, _ = load_model_and_processor(paths["vlm"])
    with_eos_bias(model, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return model.eval(), processor


@pytest.fixture(scope="module")
def lm(paths):
    model, tokenizer, _ = load_model_and_processor(paths["lm"])
    with_eos_bias(model, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return model.eval(), tokenizer


def test_engine_shapes_groups_and_masks(vlm):
    model, processor = vlm
    engine = HFGenerationEngine(model, processor, micro_batch_size=5)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(n=8, max_new_tokens=8, seed=0)
    batch = engine.generate(samples(), params)
    rows = 3 * 8
    assert len(batch) == rows and len(batch.responses) == rows
    assert batch.group_index.tolist() == [g for g in range(3) for _ in range(8)]
    assert [s.index for s in batch.samples] == batch.group_index.tolist()
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.shape[0] == rows
    assert batch.response_ids.shape == batch.response_mask.shape == (rows, batch.response_ids.shape[1])
    assert batch.response_ids.shape[1] <= 8
    # Rows of one prompt share its prompt tokens and its image inputs.
    for g in range(3):
        block = batch.prompt_ids[batch.group_index == g]
        assert bool((block == block[0]).all())
    assert batch.model_inputs[0] is batch.model_inputs[7]
    assert batch.model_inputs[16] == {}
    assert torch.equal(batch.loss_mask, batch.response_mask)

    eos = set(engine.eos_token_ids)
    pad = engine.pad_token_id
    assert {processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} <= eos
    for ids, mask, truncated in zip(batch.response_ids.tolist(), batch.response_mask.tolist(), batch.truncated.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)  # contiguous from the start
        assert all(t == pad for t in ids[length:])
        if truncated:
            assert length == 8 and not eos & set(ids[:length])
        else:
            assert ids[length - 1] in eos and not eos & set(ids[: length - 1])
    # With EOS at ~15% a step both kinds occur among 24 rows (seeded, so this is fixed).
    assert batch.truncated.any() and (~batch.truncated).any()


def test_responses_are_decoded_without_specials(lm):
    model, tokenizer = lm
    batch = HFGenerationEngine(model, tokenizer).generate(text_samples(), SamplingParams(n=4, max_new_tokens=8, seed=3))
    for text, ids, mask in zip(batch.responses, batch.response_ids, batch.response_mask):
        assert text == tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        assert "<|im_end|>" not in text


def test_seed_determinism_and_rng_isolation(vlm):
    model, processor = vlm
    engine = HFGenerationEngine(model, processor)
    params = SamplingParams(n=4, max_new_tokens=8, seed=11)
    state = torch.get_rng_state()
    first = engine.generate(samples(), params)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG did not move
    second = engine.generate(samples(), params)
    assert torch.equal(first.response_ids, second.response_ids)
    assert first.responses == second.responses
    other = engine.generate(samples(), SamplingParams(n=4, max_new_tokens=8, seed=12))
    assert first.responses != other.responses
    # Samples of one prompt differ from each other (they are samples, not copies).
    assert len({tuple(r) for r in first.response_ids[:4].tolist()}) > 1


def test_greedy_is_deterministic_and_micro_batch_invariant(vlm):
    model, processor = vlm
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    whole = HFGenerationEngine(model, processor).generate(samples(), params)
    split = HFGenerationEngine(model, processor, micro_batch_size=1).generate(samples(), params)
    assert torch.equal(whole.response_ids, split.response_ids)
    assert torch.equal(whole.response_ids[0], whole.response_ids[1])  # greedy: every sample of a prompt alike


def test_eval_mode_restored(lm):
    model, tokenizer = lm
    model.train()
    model.model.layers[0].eval()  # a submodule deliberately in eval stays so
    HFGenerationEngine(model, tokenizer).generate(text_samples(), SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training
    model.eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_generation(vlm, temperature):
    model, processor = vlm
    params = SamplingParams(n=3, max_new_tokens=8, seed=5, temperature=temperature, return_log_probs=True)
    batch = HFGenerationEngine(model, processor, micro_batch_size=4).generate(samples(), params)
    with torch.no_grad():
        log_probs, entropy = compute_log_probs(
            model, batch, micro_batch_size=2, temperature=temperature, with_entropy=True
        )
    assert log_probs.shape == entropy.shape == batch.response_ids.shape
    assert torch.allclose(log_probs, batch.rollout_log_probs, atol=1e-4)
    assert bool((log_probs[batch.response_mask == 0] == 0).all())
    real = batch.response_mask.bool()
    assert bool((log_probs[real] < 0).all())
    vocab = model.config.text_config.vocab_size
    assert bool((entropy[real] > 0).all()) and bool((entropy[real] <= math.log(vocab) + 1e-4).all())


def test_vlm_log_probs_are_of_the_distribution_without_placeholder_tokens(vlm):
    """Every engine keeps image/video placeholders out of responses (vLLM's log-probs include that), so
    the trainer scores the same restricted policy: log p(y) - log(1 - sum of the placeholders' p)."""
    from grouprl.models.inputs import placeholder_token_ids

    model, processor = vlm
    suppressed = placeholder_token_ids(model)
    assert len(suppressed) >= 3  # image, video, vision start/end
    batch = HFGenerationEngine(model, processor).generate(samples()[:1], SamplingParams(n=1, max_new_tokens=6, seed=3))
    with torch.no_grad():
        scored = compute_log_probs(model, batch, micro_batch_size=1)[0][0]
        prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()]
        response = batch.response_ids[0][batch.response_mask[0].bool()]
        ids = torch.cat([prompt, response])[None]
        # the trainer's own positions (M-RoPE from the image grid), on the full vocabulary
        kwargs = forward_kwargs(model, ids, torch.ones_like(ids), batch.model_inputs[0])
        logits = model(**kwargs).logits[0, len(prompt) - 1: -1].float()
    full = torch.log_softmax(logits, -1)
    held = full[:, suppressed].exp().sum(-1)  # the placeholders' share, which no sample ever takes
    expected = full.gather(-1, response[:, None])[:, 0] - torch.log1p(-held)
    assert bool((held > 1e-4).all())  # a random model gives them real mass: the check can tell
    assert torch.allclose(scored[: len(response)], expected, atol=1e-5)


def test_text_model_log_probs_match_generation(lm):
    model, tokenizer = lm
    params = SamplingParams(n=3, max_new_tokens=8, seed=2, return_log_probs=True)
    batch = HFGenerationEngine(model, tokenizer).generate(text_samples(), params)
    assert batch.prompt_mask[:, 0].tolist() != batch.prompt_mask[:, -1].tolist()  # prompts of two lengths
    with torch.no_grad():
        log_probs, entropy = compute_log_probs(model, batch, micro_batch_size=6)
    assert entropy is None
    assert torch.allclose(log_probs, batch.rollout_log_probs, atol=1e-4)


def _padded(t, left=0, right=0, value=0):
    return torch.nn.functional.pad(t, (left, right), value=value)


@pytest.mark.parametrize("which", ["vlm", "lm"])
def test_padding_does_not_change_log_probs(which, request):
    model, processor = request.getfixturevalue(which)
    pad = processor.tokenizer.pad_token_id if which == "vlm" else processor.pad_token_id
    chosen = samples() if which == "vlm" else text_samples()
    batch = HFGenerationEngine(model, processor).generate(chosen, SamplingParams(n=2, max_new_tokens=8, seed=4))
    with torch.no_grad():
        alone = [
            forward_response_log_probs(
                model,
                batch.prompt_ids[i : i + 1][:, batch.prompt_mask[i].bool()],
                torch.ones(1, int(batch.prompt_mask[i].sum()), dtype=torch.long),
                batch.response_ids[i : i + 1, : int(batch.response_mask[i].sum())],
                batch.response_mask[i : i + 1, : int(batch.response_mask[i].sum())],
                batch.model_inputs[i],
            )[0][0]
            for i in range(len(batch))
        ]
        # The whole batch in one micro-batch, with 5 extra pad columns on the left and 3 on the right.
        together, _ = forward_response_log_probs(
            model,
            _padded(batch.prompt_ids, left=5, value=pad),
            _padded(batch.prompt_mask, left=5),
            _padded(batch.response_ids, right=3, value=pad),
            _padded(batch.response_mask, right=3),
            collate_model_inputs(batch.model_inputs),
        )
    for i, row in enumerate(alone):
        assert torch.allclose(together[i, : len(row)], row, atol=1e-5), f"row {i}"
        assert bool((together[i, len(row) :] == 0).all())


def test_log_probs_with_grad_and_row_subset(vlm):
    model, processor = vlm
    batch = HFGenerationEngine(model, processor).generate(samples(), SamplingParams(n=2, max_new_tokens=6, seed=8))
    rows = [5, 0, 3]
    log_probs, _ = compute_log_probs(model, batch, micro_batch_size=2, rows=rows)
    assert log_probs.shape == (3, batch.response_ids.shape[1]) and log_probs.requires_grad
    (-(log_probs.sum())).backward()
    visual_grad = model.model.visual.patch_embed.proj.weight.grad
    assert visual_grad is not None and bool(visual_grad.abs().sum() > 0)  # images reach the loss
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        full, _ = compute_log_probs(model, batch, micro_batch_size=4)
    assert torch.allclose(log_probs.detach(), full[rows], atol=1e-5)


def test_generation_through_lora_model(paths):
    model, processor, _ = load_model_and_processor(paths["vlm"])
    policy = apply_lora(model, rank=4, alpha=8)
    policy.train()
    engine = HFGenerationEngine(policy, processor)
    batch = engine.generate(samples()[:2], SamplingParams(n=2, max_new_tokens=5, seed=1, return_log_probs=True))
    assert batch.response_ids.shape[0] == 4 and policy.training
    with torch.no_grad():
        log_probs, _ = compute_log_probs(policy, batch, micro_batch_size=4)
    assert torch.allclose(log_probs, batch.rollout_log_probs, atol=1e-4)
    engine.update_weights(iter(()))  # shares the policy: a no-op


def test_wrapped_model_is_unwrapped_for_generation(lm):
    model, tokenizer = lm

    class Wrapper(torch.nn.Module):  # what DDP / accelerate put around the policy
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    params = SamplingParams(n=2, max_new_tokens=4, seed=9, return_log_probs=True)
    direct = HFGenerationEngine(model, tokenizer).generate(text_samples(), params)
    wrapped = HFGenerationEngine(Wrapper(model), tokenizer).generate(text_samples(), params)
    assert torch.equal(direct.response_ids, wrapped.response_ids)
    with torch.no_grad():
        log_probs, _ = compute_log_probs(Wrapper(model), wrapped, micro_batch_size=4)
    assert torch.allclose(log_probs, wrapped.rollout_log_probs, atol=1e-4)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="n must be a positive integer, got n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0).greedy and SamplingParams(do_sample=False).log_prob_temperature == 1.0


def test_rollout_batch_concat(lm):
    model, tokenizer = lm
    engine = HFGenerationEngine(model, tokenizer)
    a = engine.generate(text_samples(), SamplingParams(n=2, max_new_tokens=3, seed=1, return_log_probs=True))
    b = engine.generate(text_samples()[:1], SamplingParams(n=2, max_new_tokens=7, seed=2, return_log_probs=True))
    merged = RolloutBatch.concat([a, b], pad_token_id=tokenizer.pad_token_id)
    assert len(merged) == 6
    assert merged.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    width = max(a.response_ids.shape[1], b.response_ids.shape[1])
    assert merged.response_ids.shape[1] == merged.rollout_log_probs.shape[1] == width
    assert merged.responses == a.responses + b.responses
    with torch.no_grad():
        log_probs, _ = compute_log_probs(model, merged, micro_batch_size=6)
    assert torch.allclose(log_probs, merged.rollout_log_probs, atol=1e-4)
    assert merged.select([4, 5]).group_index.tolist() == [2, 2]
