"""Log-probs of responses three ways that must agree: padded rows with full-vocabulary logits (the
reference, computed here directly), padding-free packed rows, and the output layer run in chunks
of tokens (``grouprl.rollout.logprobs``). Text and Qwen-VL models, gradients included."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM

from grouprl.data.sample import Sample
from grouprl.models.inputs import encode_prompts, forward_kwargs, placeholder_token_ids, tokenizer_of
from grouprl.models.loading import load_model_and_processor
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.logprobs import (
    check_padding_free,
    compute_log_probs,
    forward_response_log_probs,
    output_layer,
    pad_fraction,
    suppress_tokens,
)

CORPUS = ["a b c d e f g h i j k l m n o p", "Describe the picture.", "No picture here, say a b c."]
MODES = [pytest.param(False, None, id="padded-full"), pytest.param(False, 3, id="padded-chunked"),
         pytest.param(True, None, id="packed-full"), pytest.param(True, 3, id="packed-chunked")]


def reference_log_probs(model, prompt_ids, prompt_mask, response_ids, response_mask, extra, temperature=1.0):
    """The definition: one padded forward, the logits of every position, log-softmax at the response."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    logits = model(**forward_kwargs(model, ids, mask, extra), use_cache=False).logits.float() / temperature
    logits = suppress_tokens(logits, placeholder_token_ids(model))
    logits = logits[:, prompt_ids.shape[1] - 1 : -1]
    log_probs = torch.log_softmax(logits, -1)
    picked = log_probs.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    probs = log_probs.exp()
    entropy = -torch.where(probs > 0, probs * log_probs, 0.0).sum(-1)
    keep = response_mask.bool()
    return torch.where(keep, picked, 0.0), torch.where(keep, entropy, 0.0).detach()


def text_rows(vocab: int, rows: int = 5, prompt: int = 6, response: int = 9):
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding of different widths
    prompt_mask[2, :1] = 0
    lengths = torch.tensor([9, 2, 5, 1, 7, 3, 4, 8])[:rows]
    response_mask = (torch.arange(response)[None] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (rows, prompt), generator=g) * prompt_mask
    response_ids = torch.randint(3, vocab, (rows, response), generator=g) * response_mask
    return prompt_ids, prompt_mask, response_ids, response_mask


def gradients(model, log_probs) -> torch.Tensor:
    model.zero_grad()
    weights = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(1))
    (log_probs * weights).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture(scope="module")
def text_model(tiny_text_lm):
    return AutoModelForCausalLM.from_pretrained(tiny_text_lm(CORPUS, seed=0))


@pytest.mark.parametrize(("padding_free", "chunk"), MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_text_log_probs_entropy_and_gradients_equal_the_full_logits(text_model, padding_free, chunk, temperature):
    rows = text_rows(text_model.config.vocab_size)
    expected, expected_entropy = reference_log_probs(text_model, *rows, {}, temperature)
    expected_grad = gradients(text_model, expected)
    log_probs, entropy = forward_response_log_probs(text_model, *rows, {}, temperature, with_entropy=True,
                                                    padding_free=padding_free, chunk_tokens=chunk)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=2e-6)
    assert not entropy.requires_grad
    grad = gradients(text_model, log_probs)
    assert expected_grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_lora_policy_scores_packed_and_chunked_like_the_full_logits(text_model):
    from peft import LoraConfig, get_peft_model

    import copy

    policy = get_peft_model(copy.deepcopy(text_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False))
    rows = text_rows(text_model.config.vocab_size)
    assert output_layer(policy) is not None  # the adapters are elsewhere: the output layer is plain
    expected, _ = reference_log_probs(policy, *rows, {})
    log_probs, _ = forward_response_log_probs(policy, *rows, {}, padding_free=True, chunk_tokens=2)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=2e-6)
    with policy.disable_adapter():
        base, _ = forward_response_log_probs(policy, *rows, {}, padding_free=True, chunk_tokens=2)
    torch.testing.assert_close(base, reference_log_probs(text_model, *rows, {})[0], rtol=1e-5, atol=2e-6)


def largest_saved_rows(run, vocab: int):
    """(the most rows of [*, vocab] tensors, i.e. logits, autograd saved for the backward while ``run()``
    ran, what ``run()`` returned)."""
    sizes = []

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == vocab:
            sizes.append(t.numel() // vocab)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return max(sizes, default=0), result


def test_chunked_backward_never_holds_the_logits_of_all_positions(text_model):
    """With gradients on, what autograd keeps for the backward pass is at most one chunk of logits."""
    rows = text_rows(text_model.config.vocab_size, rows=8)
    vocab = text_model.config.vocab_size
    scored = int(rows[3].sum())

    def largest_saved_logits(chunk):
        return largest_saved_rows(lambda: forward_response_log_probs(text_model, *rows, {}, chunk_tokens=chunk),
                                  vocab)[0]

    assert largest_saved_logits(None) >= scored  # all response positions' logits at once
    assert largest_saved_logits(4) <= 4


def vlm_builders():
    from test_model_families import build_tiny_qwen2_vl, build_tiny_qwen3_vl  # tests/core, same folder

    from grouprl.models.tiny import build_tiny_vlm

    return {"qwen2_5_vl": (lambda d: build_tiny_vlm(d, CORPUS, seed=0), 112),
            "qwen2_vl": (build_tiny_qwen2_vl, None), "qwen3_vl": (build_tiny_qwen3_vl, None)}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_padding_free_vlm_with_zero_one_and_two_images_equals_the_padded_forward(family, tmp_path):
    import test_model_families

    build, size = vlm_builders()[family]
    model, processor, _ = load_model_and_processor(build(tmp_path / "model"))
    size = size or test_model_families.IMAGE_SIZE

    def picture(colour):
        return Image.new("RGB", (size, size), colour)

    samples = [
        Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
               images=[picture((200, 10, 10))]),
        Sample(messages=[{"role": "user", "content": [{"type": "text", "text": "No picture here, say a b c."}]}]),
        Sample(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                      {"type": "image"}]}],
               images=[picture((0, 90, 10)), picture((5, 5, 250))]),
    ]
    prompt_ids, prompt_mask, extra = encode_prompts(processor, samples)
    words = torch.tensor(tokenizer_of(processor)("a b c d e f g h", add_special_tokens=False).input_ids)
    g = torch.Generator().manual_seed(0)
    response_mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4])[:, None]).long()
    response_ids = words[torch.randint(0, len(words), (3, 6), generator=g)] * response_mask
    for rows in ([0, 1, 2], [1]):  # images in the micro-batch, and a text-only one on the VLM
        args = (prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows])
        collated = {}
        if any(extra[i] for i in rows):
            from grouprl.models.inputs import collate_model_inputs

            collated = collate_model_inputs([extra[i] for i in rows])
        expected, expected_entropy = reference_log_probs(model, *args, collated)
        expected_grad = gradients(model, expected)
        log_probs, entropy = forward_response_log_probs(model, *args, collated, with_entropy=True, padding_free=True,
                                                        chunk_tokens=4)
        torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=5e-6)
        torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=5e-6)
        torch.testing.assert_close(gradients(model, log_probs), expected_grad, rtol=1e-4, atol=1e-6)


def test_padding_free_refuses_an_attention_that_cannot_separate_sequences(tiny_text_lm):
    model = AutoModelForCausalLM.from_pretrained(tiny_text_lm(CORPUS, seed=0))
    check_padding_free(model)  # sdpa: fine
    model.config._attn_implementation = "flex_attention"
    rows = text_rows(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"padding_free.*'flex_attention'.*padding_free: false"):
        forward_response_log_probs(model, *rows, {}, padding_free=True)


def test_softcapped_logits_are_scored_from_the_models_own_output():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=2.0, attn_implementation="eager"))
    assert output_layer(model) is None  # the head alone would not give the model's logits
    rows = text_rows(64)
    expected, _ = reference_log_probs(model, *rows, {})
    log_probs, _ = forward_response_log_probs(model, *rows, {}, chunk_tokens=3)
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=2e-6)


def batch_of(rows) -> RolloutBatch:
    prompt_ids, prompt_mask, response_ids, response_mask = rows
    n = len(prompt_ids)
    return RolloutBatch(samples=[Sample(messages=[{"role": "user", "content": "x"}], index=i) for i in range(n)],
                        group_index=torch.zeros(n, dtype=torch.long), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                        response_ids=response_ids, response_mask=response_mask, responses=[""] * n,
                        truncated=torch.zeros(n, dtype=torch.bool))


def test_micro_batch_plans_give_rows_back_in_order(text_model):
    batch = batch_of(text_rows(text_model.config.vocab_size))
    with torch.no_grad():
        expected, _ = compute_log_probs(text_model, batch, micro_batch_size=2)
        planned, _ = compute_log_probs(text_model, batch, micro_batch_size=2, padding_free=True,
                                       micro_batches=[torch.tensor([3, 0]), torch.tensor([2]), torch.tensor([1, 4])])
        torch.testing.assert_close(planned, expected, rtol=1e-5, atol=2e-6)
        with pytest.raises(ValueError, match="each of the 5 rows exactly once"):
            compute_log_probs(text_model, batch, micro_batch_size=2, micro_batches=[torch.tensor([0, 1, 2, 3])])


def test_pad_fraction_counts_the_positions_a_padded_forward_computes():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    real = 3 + 2 + 1 + 4 + 1 + 2  # 13 tokens
    # one micro-batch: 3 rows x (3 prompt + 4 response) = 21 positions
    assert pad_fraction(prompt_mask, response_mask, [torch.arange(3)], padding_free=False) == pytest.approx(1 - 13 / 21)
    # rows 1 and 2 together: 2 x (3 + 2); row 0 alone: 1 x (2 + 4)
    two = [torch.tensor([0]), torch.tensor([1, 2])]
    assert pad_fraction(prompt_mask, response_mask, two, padding_free=False) == pytest.approx(1 - real / 16)
    assert pad_fraction(prompt_mask, response_mask, two, padding_free=True) == 0.0
