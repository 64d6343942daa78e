"""hf_lean: grouprl's own decoding loop, checked against transformers ``generate`` and the trainer's scoring."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, SuppressTokensLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from grouprl.config import config_from_dict
from grouprl.models.inputs import encode_prompts
from grouprl.models.loading import apply_lora, load_model_and_processor
from grouprl.rollout.engine import EncodedPrompt, SamplingParams, engine_class
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.lean_engine import (LeanGenerationEngine, _FusedDecoder, fused_decoder_supported,
                                         process_scores, sample_categorical)
from grouprl.rollout.logprobs import compute_log_probs

from test_engine import lm, samples, text_samples, vlm, with_eos_bias  # noqa: F401  (fixtures and helpers)
from test_model_families import build_tiny_qwen2_vl, build_tiny_qwen3_vl


def test_hf_lean_is_registered_and_takes_plain_qwen2_the_fused_way(lm):  # noqa: F811
    model, tokenizer = lm
    assert engine_class("hf_lean") is LeanGenerationEngine
    assert fused_decoder_supported(model) and LeanGenerationEngine(model, tokenizer).fused
    assert not LeanGenerationEngine(model, tokenizer, fused=False).fused


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("eos_bias", [False, True])
def test_greedy_decodes_what_generate_decodes(paths, fused, eos_bias):
    """Greedy: the same tokens, masks, texts and log-probs as transformers generate (hf)."""
    model, tokenizer, _ = load_model_and_processor(paths["lm"])
    model.eval()
    if eos_bias:  # rows end at different steps: the pad after EOS and the early stop are exercised
        with_eos_bias(model, tokenizer.convert_tokens_to_ids("<|im_end|>"), probability=0.3)
    params = SamplingParams(n=3, temperature=0, max_new_tokens=10, return_log_probs=True)
    want = HFGenerationEngine(model, tokenizer).generate(text_samples(), params)
    got = LeanGenerationEngine(model, tokenizer, fused=fused).generate(text_samples(), params)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.truncated, want.truncated) and got.responses == want.responses
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_sampled_log_probs_are_the_trainers(lm, fused):  # noqa: F811
    """Sampling (temperature, top-k, top-p): EOS handled, seeded, and the sampler's log-probs are
    the trainer's (compute_log_probs) to 1e-5."""
    model, tokenizer = lm
    engine = LeanGenerationEngine(model, tokenizer, fused=fused)
    params = SamplingParams(n=8, temperature=1.2, top_p=0.97, top_k=200, max_new_tokens=8, seed=7,
                            return_log_probs=True)
    got = engine.generate(text_samples(), params)
    assert torch.equal(got.response_ids, engine.generate(text_samples(), params).response_ids)
    other = engine.generate(text_samples(), SamplingParams(**{**params.__dict__, "seed": 8}))
    assert not torch.equal(got.response_ids, other.response_ids)
    assert got.response_ids.shape[1] <= 8
    assert got.truncated.any() and not got.truncated.all()  # some rows ended with EOS, some ran out
    with torch.no_grad():
        scored, _ = compute_log_probs(model, got, micro_batch_size=16, temperature=1.2)
    torch.testing.assert_close(scored, got.rollout_log_probs, atol=1e-5, rtol=0)

    # a continuation from token ids samples what the messages' prompt samples
    ids, mask, _ = encode_prompts(tokenizer, text_samples())
    prompts = [EncodedPrompt(row[m.bool()]) for row, m in zip(ids, mask)]
    assert torch.equal(engine.generate(text_samples(), params, prompts=prompts).response_ids, got.response_ids)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (1.2, 200, 0.97), (0.7, 20, 0.9)])
def test_seeded_samples_are_generates(lm, fused, temperature, top_k, top_p):  # noqa: F811
    """With the same seed, hf_lean samples the very responses transformers generate (hf) samples:
    the same processed distribution, drawn from the same random numbers."""
    model, tokenizer = lm
    params = SamplingParams(n=8, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8, seed=11,
                            return_log_probs=True)
    want = HFGenerationEngine(model, tokenizer).generate(text_samples(), params)
    got = LeanGenerationEngine(model, tokenizer, fused=fused).generate(text_samples(), params)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.truncated, want.truncated) and got.responses == want.responses
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 5, 1.0), (1.3, None, 0.8),
                                                     (0.5, 50, 0.6)])
def test_processing_and_draws_are_transformers(temperature, top_k, top_p):
    """The filtered scores are exactly transformers' processors' (suppress, temperature, top-k, top-p),
    and a draw is torch.multinomial's from the same random numbers."""
    torch.manual_seed(0)
    scores = torch.randn(64, 40) * 2
    suppressed = [3, 17]
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p)
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor(suppressed)])
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    want = processors(torch.zeros(64, 1, dtype=torch.long), scores.clone())
    got = process_scores(scores.clone(), config, suppressed)
    assert torch.equal(got, want)

    probs = torch.softmax(got, dim=-1)
    torch.manual_seed(5)
    drawn = torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(5)
    assert torch.equal(sample_categorical(probs.clone()), drawn)
    assert (probs.gather(1, drawn[:, None]) > 0).all()


def test_fused_forward_is_the_models_forward(lm):  # noqa: F811
    """Prefill over left-padded prompts, then decode steps: the written-out forward's logits are the model's."""
    model, tokenizer = lm
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    decoder = _FusedDecoder(model, 3, 9)
    prompt, positions = 6, (mask.cumsum(-1) - 1).clamp(min=0)
    got = [decoder(ids[:, :prompt], mask[:, :prompt], positions[:, :prompt])]
    for t in range(prompt, 9):
        got.append(decoder(ids[:, t : t + 1], mask[:, : t + 1], positions[:, t : t + 1]))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    for step, logits in enumerate(got):
        t = prompt - 1 + step
        real = mask[:, t].bool()  # a padding position's output is never read
        torch.testing.assert_close(logits[real], full[real, t], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- vision-language models

VLM_BUILDERS = {"qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl}


def load_vlm(paths, tmp_path_factory, family):
    """A tiny VLM of ``family`` ending its turn with probability 0.1 a step (qwen2_5_vl: the engine tests')."""
    path = paths["vlm"] if family == "qwen2_5_vl" else VLM_BUILDERS[family](tmp_path_factory.mktemp(family))
    model, processor, _ = load_model_and_processor(path)
    with_eos_bias(model, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), probability=0.1)
    return model.eval(), processor


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def fused_vlm(request, paths, tmp_path_factory):
    return (*load_vlm(paths, tmp_path_factory, request.param), request.param)


# A random model's logits are nearly flat: an EOS probability of this (per family) makes greedy rows
# of different prompts end at different steps, or not at all.
GREEDY_EOS_PROBABILITY = {"qwen2_5_vl": 0.008, "qwen2_vl": 0.006}


@contextlib.contextmanager
def token_probability(model, token, probability):
    """About ``probability`` a step for ``token`` (on the biased head of ``with_eos_bias``), within the block."""
    head = model.get_output_embeddings()
    saved = head.bias[token].item()
    with torch.no_grad():
        head.bias[token] = math.log(probability / (1 - probability) * (head.out_features - 1))
    try:
        yield
    finally:
        with torch.no_grad():
            head.bias[token] = saved


def assert_same_rollouts(got, want):
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.truncated, want.truncated) and got.responses == want.responses
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=1e-5)


def assert_varied(batch, distinct=3):
    """Not a trivial match: the rows differ, and some end at EOS (at different steps) while others run out."""
    assert len({tuple(r) for r in batch.response_ids.tolist()}) >= distinct
    ended = batch.response_mask.sum(1)[~batch.truncated]
    assert batch.truncated.any() and len(set(ended.tolist())) > 1


VLM_SAMPLING = [pytest.param(dict(temperature=0), id="greedy"),
                pytest.param(dict(temperature=1.0, seed=3), id="plain"),
                pytest.param(dict(temperature=1.2, top_k=100, top_p=0.95, seed=5), id="top_k_top_p")]


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("sampling", VLM_SAMPLING)
def test_vlm_rollouts_are_generates(fused_vlm, fused, sampling):
    """Qwen2.5-VL and Qwen2-VL with 1, 2 and 0 images a prompt, left-padded to different lengths,
    micro-batches of 4 (one without images): hf_lean gives hf's tokens and log-probs, greedy and
    sampled, on the written-out decoder (the default for them) and on the model's forward."""
    model, processor, family = fused_vlm
    params = SamplingParams(n=3, max_new_tokens=8, return_log_probs=True, **sampling)
    greedy = params.greedy
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with token_probability(model, eos, GREEDY_EOS_PROBABILITY[family]) if greedy else contextlib.nullcontext():
        want = HFGenerationEngine(model, processor, micro_batch_size=4).generate(samples(), params)
        engine = LeanGenerationEngine(model, processor, micro_batch_size=4, fused=fused)
        assert engine.fused is (fused is None)
        got = engine.generate(samples(), params)
    assert_same_rollouts(got, want)
    assert_varied(got, distinct=3 if greedy else 6)
    assert len({int(m.sum()) for m in got.prompt_mask}) == 3  # three prompt lengths, left-padded together


@pytest.mark.parametrize("fused", [None, False])
def test_vlm_placeholders_are_suppressed_as_generate_does(fused_vlm, fused):
    """A model that would sample the image placeholder half the time: both engines keep it (and the
    other vision tokens) out, draw the same tokens, and give the same log-probs."""
    model, processor, _ = fused_vlm
    engine = LeanGenerationEngine(model, processor, micro_batch_size=4, fused=fused)
    image_pad = model.config.image_token_id
    assert image_pad in engine.suppressed_token_ids
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=3, return_log_probs=True)
    with token_probability(model, image_pad, 0.5):
        want = HFGenerationEngine(model, processor, micro_batch_size=4).generate(samples(), params)
        got = engine.generate(samples(), params)
    assert_same_rollouts(got, want)
    assert not torch.isin(got.response_ids, torch.tensor(engine.suppressed_token_ids)).any()


def test_fused_decoder_is_the_vlm_language_models_forward_under_m_rope(fused_vlm):
    """Positions whose t, h, w rows differ (an image's): the written-out decoder turns each band of
    frequencies by its M-RoPE section's row, as the language model does; then decode steps after
    ``load_cache`` of the language model's own cache."""
    model, _, _ = fused_vlm
    torch.manual_seed(2)
    ids = torch.randint(5, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = torch.stack([(mask.cumsum(-1) - 1).clamp(min=0)] * 3) + torch.tensor([0, 3, 5])[:, None, None]
    positions[1:, :, 2:4] += torch.tensor([[1, 2], [2, 0]])[:, None, :]  # an "image" whose rows differ
    language_model = model.model.language_model
    with torch.no_grad():
        hidden = language_model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        want = model.lm_head(hidden[:, -1])
    decoder = _FusedDecoder(model, 2, 9)
    torch.testing.assert_close(decoder(ids, mask, positions), want, atol=1e-5, rtol=1e-5)

    prompt = 5  # the model's forward over the first columns, then the decoder from its cache
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        language_model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt],
                       position_ids=positions[..., :prompt], cache=cache, use_cache=True)
    decoder = _FusedDecoder(model, 2, 9)
    decoder.load_cache(cache)
    for t in range(prompt, 7):
        got = decoder(ids[:, t:t + 1], mask[:, :t + 1], positions[..., t:t + 1])
        with torch.no_grad():
            hidden = language_model(input_ids=ids[:, :t + 1], attention_mask=mask[:, :t + 1],
                                    position_ids=positions[..., :t + 1]).last_hidden_state
        torch.testing.assert_close(got, model.lm_head(hidden[:, -1]), atol=1e-5, rtol=1e-5)


def test_vlm_continues_from_token_ids_and_image_tensors(fused_vlm):
    """Prompts given as ids with their images' tensors (a dialogue's next turn): hf_lean samples what it
    samples from the messages, and what hf samples from the same ids."""
    model, processor, _ = fused_vlm
    ids, mask, inputs = encode_prompts(processor, samples())
    prompts = [EncodedPrompt(row[m.bool()], extra) for row, m, extra in zip(ids, mask, inputs)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4, return_log_probs=True)
    engine = LeanGenerationEngine(model, processor)
    got = engine.generate(samples(), params, prompts=prompts)
    assert torch.equal(got.response_ids, engine.generate(samples(), params).response_ids)
    assert_same_rollouts(got, HFGenerationEngine(model, processor).generate(samples(), params, prompts=prompts))


def test_vlm_decodes_on_the_fused_decoder(fused_vlm):
    model, processor, _ = fused_vlm
    assert fused_decoder_supported(model)
    assert LeanGenerationEngine(model, processor).fused and LeanGenerationEngine(model, processor, fused=True).fused


def test_vlm_with_lora_falls_back_to_the_models_forward(paths):
    """LoRA'd projections are not bare nn.Linear: the model's own forward decodes, and still samples hf's tokens."""
    model, processor = load_vlm(paths, None, "qwen2_5_vl")
    model = apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # adapters that change the logits (lora_B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    assert not fused_decoder_supported(model)
    engine = LeanGenerationEngine(model, processor, micro_batch_size=4)
    assert not engine.fused
    with pytest.raises(ValueError, match="fused=True needs a plain Qwen2"):
        LeanGenerationEngine(model, processor, fused=True)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=3, return_log_probs=True)
    want = HFGenerationEngine(model, processor, micro_batch_size=4).generate(samples(), params)
    got = engine.generate(samples(), params)
    assert_same_rollouts(got, want)
    assert_varied(got, distinct=6)


@pytest.mark.parametrize("sampling", VLM_SAMPLING[1:])
def test_qwen3_vl_decodes_on_the_models_forward(paths, tmp_path_factory, sampling):
    """Qwen3-VL (interleaved M-RoPE, q/k norms, deepstack): not the written-out decoder's, so the model's
    own forward prefills and decodes; the tokens and log-probs are still hf's."""
    model, processor = load_vlm(paths, tmp_path_factory, "qwen3_vl")
    assert not fused_decoder_supported(model)
    engine = LeanGenerationEngine(model, processor, micro_batch_size=4)
    assert not engine.fused
    params = SamplingParams(n=3, max_new_tokens=8, return_log_probs=True, **sampling)
    want = HFGenerationEngine(model, processor, micro_batch_size=4).generate(samples(), params)
    got = engine.generate(samples(), params)
    assert_same_rollouts(got, want)
    assert_varied(got, distinct=6)


def test_fused_needs_a_plain_qwen2_or_llama(lm):  # noqa: F811
    model, tokenizer = lm

    class Wrapped(torch.nn.Module):  # e.g. a LoRA or quantised projection
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    attn = model.model.layers[0].self_attn
    plain = attn.q_proj
    attn.q_proj = Wrapped(plain)
    try:
        assert not fused_decoder_supported(model)
        assert not LeanGenerationEngine(model, tokenizer).fused  # the model's own forward instead
        with pytest.raises(ValueError, match="fused=True needs a plain Qwen2, Llama"):
            LeanGenerationEngine(model, tokenizer, fused=True)
    finally:
        attn.q_proj = plain


def test_trainer_trains_with_hf_lean(tmp_path, paths):
    import json

    from grouprl.trainer.grpo import GRPOTrainer

    records = [{"problem": f"Heart size {i}?", "answer": "normal"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = {
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(paths["lm"])}, "global_batch_size": 4},
                   "rollout": {"n": 2, "engine": "hf_lean"},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 3}}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "logger": ["jsonl"], "device": "cpu"},
    }
    trainer = GRPOTrainer(config_from_dict(cfg))
    assert isinstance(trainer.engine, LeanGenerationEngine) and trainer.engine.fused
    trainer.train()

