"""Engines by name, prompts given in token space, and the static-cache compiled engine (hf_static)."""

from __future__ import annotations

import pytest
import torch

from grouprl.config import ConfigError, config_from_dict
from grouprl.models.loading import load_model_and_processor
from grouprl.models.inputs import encode_prompts
from grouprl.rollout.engine import (ROLLOUT_ENGINES, EncodedPrompt, RolloutEngine, SamplingParams, build_engine,
                                    engine_class, engine_names, register_engine)
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs
from grouprl.rollout.static_engine import StaticCacheEngine

from test_engine import lm, samples, text_samples, vlm  # noqa: F401  (fixtures and helpers)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is asked to compile and runs them as traced.

    transformers deep-copies the compile options, so the count lives in the function's closure
    (a function survives a deep copy as itself; an object would be copied)."""

    def __init__(self):
        graphs = []

        def backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        self.backend, self._graphs = backend, graphs

    @property
    def compiled(self) -> int:
        return len(self._graphs)


def test_engines_are_chosen_by_name():
    assert {"hf", "hf_static", "hf_lean", "vllm"} <= set(engine_names())
    assert engine_class("hf") is HFGenerationEngine and engine_class("hf_static") is StaticCacheEngine
    with pytest.raises(ValueError, match="unknown rollout engine 'hff'.*hf, hf_lean, hf_static"):
        engine_class("hff")
    with pytest.raises(ConfigError, match="worker.rollout.engine"):
        config_from_dict({"worker": {"rollout": {"engine": "hff"}}})

    class Mine(HFGenerationEngine):
        pass

    class Other(HFGenerationEngine):
        pass

    register_engine("_test_mine", Mine)
    try:
        assert engine_class("_test_mine") is Mine
        config = config_from_dict({"worker": {"rollout": {"engine": "_test_mine", "micro_batch_size": 3}}})
        register_engine("_test_mine", Mine)  # the same class again: a module run twice
        with pytest.raises(ValueError, match="already registered"):
            register_engine("_test_mine", Other)
    finally:
        ROLLOUT_ENGINES.unregister("_test_mine")
    assert config.worker.rollout.engine == "_test_mine"


def test_every_engine_has_the_interface():
    for name in ("hf", "hf_static", "hf_lean"):
        cls = engine_class(name)
        assert issubclass(cls, RolloutEngine) and not cls.owns_weights


@pytest.mark.parametrize("model_name", ["lm", "vlm"])
def test_generation_continues_from_token_ids(request, model_name):
    """Given the prompts' ids (and their images' tensors), an engine samples what it samples from messages."""
    model, processor = request.getfixturevalue(model_name)
    batch_samples = text_samples() if model_name == "lm" else samples()
    ids, mask, inputs = encode_prompts(processor, batch_samples)
    prompts = [EncodedPrompt(row[m.bool()], extra) for row, m, extra in zip(ids, mask, inputs)]
    engine = HFGenerationEngine(model, processor)
    params = SamplingParams(n=2, max_new_tokens=6, seed=4, return_log_probs=True)
    from_messages = engine.generate(batch_samples, params)
    from_ids = engine.generate(batch_samples, params, prompts=prompts)
    assert torch.equal(from_ids.response_ids, from_messages.response_ids)
    assert torch.equal(from_ids.prompt_ids, from_messages.prompt_ids)

    # a dialogue goes on from its own tokens: the prompt is the earlier turn plus its response
    first = from_messages.select([0, 2 * (len(batch_samples) - 1)])
    turns = [EncodedPrompt(torch.cat([p[m.bool()], r[rm.bool()]]), first.model_inputs[i])
             for i, (p, m, r, rm) in enumerate(zip(first.prompt_ids, first.prompt_mask, first.response_ids,
                                                   first.response_mask))]
    second = engine.generate(first.samples, SamplingParams(n=1, max_new_tokens=4, seed=5), prompts=turns)
    for i, turn in enumerate(turns):
        assert torch.equal(second.prompt_ids[i][second.prompt_mask[i].bool()], turn.ids)
    with torch.no_grad():  # the continuation scores like any response to that prompt
        log_probs, _ = compute_log_probs(model, second, micro_batch_size=4)
    assert torch.isfinite(log_probs).all()

    # max_prompt_length limits first prompts; a dialogue's context grows past it by design
    short = HFGenerationEngine(model, processor, max_prompt_length=int(first.prompt_mask.sum(-1).min()) - 1)
    assert len(short.generate(first.samples, SamplingParams(n=1, max_new_tokens=2), prompts=turns)) == len(turns)
    with pytest.raises(ValueError, match="max_prompt_length"):
        short.generate(first.samples, SamplingParams(n=1, max_new_tokens=2))
    with pytest.raises(ValueError, match="encoded prompts for"):
        engine.generate(first.samples, SamplingParams(n=1, max_new_tokens=2), prompts=turns[:1])


@pytest.mark.parametrize("model_name", ["lm", "vlm"])
def test_static_engine_decodes_what_generate_decodes(paths, model_name):
    """Static cache, bucketed padding and a traced decoder: greedy gives the same tokens and log-probs."""
    model, processor, _ = load_model_and_processor(paths[model_name])  # no EOS bias: 8 tokens to compare
    batch_samples = text_samples() if model_name == "lm" else samples()
    backend = CountingBackend()
    static = StaticCacheEngine(model, processor, micro_batch_size=8, compile_backend=backend.backend, prompt_bucket=16)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8, return_log_probs=True)
    want = HFGenerationEngine(model, processor).generate(batch_samples, params)
    got = static.generate(batch_samples, params)
    assert got.response_ids.shape[1] == 8 and backend.compiled >= 1
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-4, rtol=0)
    assert got.responses == want.responses


@pytest.mark.parametrize("model_name", ["lm", "vlm"])
def test_static_engine_samples_with_the_policys_log_probs(request, model_name):
    """Sampling through the static engine: EOS handled, seeded, and the sampler's log-probs are the policy's.

    (Padding rows to the bucket changes which random numbers each row draws, so the
    samples are not plain generate's; their distribution is the same.)"""
    model, processor = request.getfixturevalue(model_name)
    batch_samples = text_samples() if model_name == "lm" else samples()
    static = StaticCacheEngine(model, processor, micro_batch_size=8, compile_backend=CountingBackend().backend,
                               prompt_bucket=16)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7, return_log_probs=True)
    got = static.generate(batch_samples, params)
    again = static.generate(batch_samples, params)
    assert torch.equal(got.response_ids, again.response_ids)
    assert got.truncated.any() and not got.truncated.all()  # some rows ended with EOS, some ran out
    with torch.no_grad():
        scored, _ = compute_log_probs(model, got, micro_batch_size=8)
    torch.testing.assert_close(scored, got.rollout_log_probs, atol=1e-4, rtol=0)


def test_static_engine_compiles_once_per_bucket(lm):  # noqa: F811
    """Prompts of other lengths in the same width bucket, and fewer rows, reuse the compiled decoder."""
    model, tokenizer = lm
    backend = CountingBackend()
    engine = StaticCacheEngine(model, tokenizer, micro_batch_size=8, compile_backend=backend.backend, prompt_bucket=64)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    engine.generate(text_samples(), params)
    compiled = backend.compiled
    assert compiled >= 1
    for n, batch in ((3, text_samples()), (1, text_samples()[:1]), (4, text_samples()[1:])):
        engine.generate(batch, SamplingParams(n=n, max_new_tokens=6, seed=n))
    assert backend.compiled == compiled  # no recompilation
    assert engine.shapes == {(8, 64, 6)}
    engine.generate(text_samples(), SamplingParams(n=2, max_new_tokens=9, seed=1))  # another cache length
    assert engine.shapes == {(8, 64, 6), (8, 64, 9)} and backend.compiled > compiled


def test_static_engine_with_inductor_matches_generate(lm):  # noqa: F811
    """The real compiler (inductor, on the CPU): compiled once, then the same greedy tokens and log-probs."""
    model, tokenizer = lm
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6, return_log_probs=True)
    want = HFGenerationEngine(model, tokenizer).generate(text_samples(), params)
    engine = StaticCacheEngine(model, tokenizer, micro_batch_size=4)
    for _ in range(2):
        got = engine.generate(text_samples(), params)
        assert torch.equal(got.response_ids, want.response_ids)
        torch.testing.assert_close(got.rollout_log_probs, want.rollout_log_probs, atol=1e-4, rtol=0)
    assert engine.shapes == {(4, 64, 6)}


def test_trainer_builds_the_configured_engine(tmp_path, paths):
    import json

    from grouprl.trainer.grpo import GRPOTrainer

    records = [{"problem": f"Heart size {i}?", "answer": "normal"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = {
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": str(paths["lm"])}, "global_batch_size": 4},
                   "rollout": {"n": 2, "engine": "hf_static", "micro_batch_size": 8,
                               "static_cache": {"backend": "eager", "prompt_bucket": 32}},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 3}}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "logger": ["jsonl"], "device": "cpu"},
    }
    trainer = GRPOTrainer(config_from_dict(cfg))
    assert isinstance(trainer.engine, StaticCacheEngine) and trainer.engine.prompt_bucket == 32
    trainer.train()
    assert trainer.engine.shapes == {(8, 32, 5)}  # every step's rollout in one shape bucket
    built = build_engine("hf", trainer.policy, trainer.processor, config=trainer.config)
    assert isinstance(built, HFGenerationEngine) and not built.holds_weights
