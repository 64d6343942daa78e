"""The vLLM engine's own code, without vLLM: arguments in, vLLM-shaped outputs back to a RolloutBatch.

vLLM itself needs a CUDA GPU; these tests feed the conversion functions plain
Python objects with the fields of vLLM's ``RequestOutput`` / ``CompletionOutput``
/ ``Logprob``, built from what the hf engine really sampled, and check that the
batch comes out exactly as ``HFGenerationEngine`` makes it.
"""

from __future__ import annotations

import copy
import importlib.util
import random
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch

from grouprl.data.sample import Sample
from grouprl.models.loading import apply_lora, load_model_and_processor
from grouprl.models.inputs import encode_prompts, render_prompt
from grouprl.models.weight_sync import gathered_named_parameters, named_weights_for_sync
from grouprl.rollout.engine import SamplingParams, engine_class
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.vllm_engine import (
    INSTALL_HINT,
    SUPPRESS_BIAS,
    VLLMEngine,
    check_images_once,
    check_prompt_images,
    collapse_image_placeholders,
    response_tensors,
    prompt_seed,
    rollout_batch_from_vllm,
    unpadded_rows,
    vllm_dtype,
    vllm_llm_kwargs,
    vllm_model,
    vllm_prompt,
    vllm_sampling_kwargs,
)

from test_engine import samples as vlm_samples, with_eos_bias  # the engine tests' prompts and EOS bias

CORPUS = [
    "Heart size is normal. No pleural effusion or pneumothorax.",
    "Mild cardiomegaly. Small left pleural effusion.",
    "No acute cardiopulmonary process. Lungs are clear.",
] * 4

HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------- vLLM's output shapes


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    text: str = ""
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    request_id: str = "0"
    finished: bool = True


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def paths(tiny_vlm, tiny_text_lm):
    return {"vlm": tiny_vlm(CORPUS, seed=2), "lm": tiny_text_lm(CORPUS, seed=2)}


@pytest.fixture(scope="module")
def vlm(paths):
    model, processor, _ = load_model_and_processor(paths["vlm"])
    # a steady chance of ending the turn, so rows both end with EOS and run out
    with_eos_bias(model, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), probability=0.1)
    return model.eval(), processor


def as_vllm_outputs(batch, n, *, prompt_token_ids, shuffle_completions=False):
    """What LLM.generate would return for the rows of an hf batch (stop token kept, per-token logprob dicts)."""
    outputs = []
    for i, ids in enumerate(prompt_token_ids):
        completions = []
        for j in range(n):
            row = i * n + j
            length = int(batch.response_mask[row].sum())
            tokens = batch.response_ids[row, :length].tolist()
            logprobs = None
            if batch.rollout_log_probs is not None:
                logprobs = [{tok: Logprob(float(batch.rollout_log_probs[row, t]), rank=1)}
                            for t, tok in enumerate(tokens)]
            completions.append(CompletionOutput(index=j, token_ids=tokens, logprobs=logprobs,
                                                finish_reason="length" if batch.truncated[row] else "stop"))
        if shuffle_completions:
            random.Random(i).shuffle(completions)
        outputs.append(RequestOutput(prompt_token_ids=list(ids), outputs=completions))
    return outputs


# ---------------------------------------------------------------------------- without vLLM


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_engine_says_how_to_install_it(paths):
    from grouprl.config import config_from_dict
    from grouprl.rollout.engine import build_engine

    assert engine_class("vllm") is VLLMEngine  # the module itself imports without vLLM
    assert VLLMEngine.owns_weights and VLLMEngine.holds_weights and VLLMEngine.supports_sleep
    model, tokenizer, _ = load_model_and_processor(paths["lm"])
    with pytest.raises(ImportError, match=r"pip install 'grouprl\[vllm\]'"):
        VLLMEngine(model, tokenizer, model_path=str(paths["lm"]))
    config = config_from_dict({"worker": {"actor": {"model": {"model_path": str(paths["lm"])}},
                                          "rollout": {"engine": "vllm"}}})
    with pytest.raises(ImportError, match=r"pip install 'grouprl\[vllm\]'"):
        build_engine("vllm", model, tokenizer, config=config, holds_weights=True)
    assert INSTALL_HINT == "pip install 'grouprl[vllm]'"


def test_sampling_params_to_vllm_kwargs():
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, seed=11,
                            return_log_probs=True)
    kwargs = vllm_sampling_kwargs(params, eos_token_ids=[9, 3, 9], suppressed_token_ids=[5, 6], prompt_index=2)
    assert kwargs == dict(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, stop_token_ids=[3, 9],
                          logprobs=0, detokenize=False, seed=prompt_seed(11, 2, 4),
                          logit_bias={5: SUPPRESS_BIAS, 6: SUPPRESS_BIAS})
    # vLLM seeds sample j of a prompt base + j: no two responses share a stream, within a call nor
    # across the calls of two processes (call seeds s, s + 1) and of the next steps (s + 101 per step)
    seeds = [vllm_sampling_kwargs(replace(params, seed=call), eos_token_ids=[3], prompt_index=i)["seed"] + j
             for call in (11, 12, 11 + 101, 11 + 202) for i in range(64) for j in range(params.n)]
    assert len(set(seeds)) == len(seeds) == 4 * 64 * params.n
    assert all(0 <= s < 2**31 for s in seeds)

    off = vllm_sampling_kwargs(SamplingParams(n=2, top_k=None), eos_token_ids=[3])
    assert off["top_k"] == -1 and off["top_p"] == 1.0 and off["temperature"] == 1.0
    assert off["logprobs"] is None and "seed" not in off and "logit_bias" not in off
    assert vllm_sampling_kwargs(SamplingParams(top_k=0), eos_token_ids=[3])["top_k"] == -1
    greedy = vllm_sampling_kwargs(SamplingParams(temperature=0.0, top_p=0.5, top_k=5), eos_token_ids=[3])
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, -1)
    no_sample = vllm_sampling_kwargs(SamplingParams(do_sample=False, temperature=0.8), eos_token_ids=[3])
    assert no_sample["temperature"] == 0.0


def test_llm_kwargs_and_their_checks():
    common = dict(dtype="bfloat16", max_model_len=1536, gpu_memory_utilization=0.6, enforce_eager=False,
                  tensor_parallel_size=1, max_num_batched_tokens=8192, enable_chunked_prefill=False,
                  enable_sleep_mode=True, limit_images=0, seed=3, trust_remote_code=False)
    single = vllm_llm_kwargs("/m", distributed=False, **common)
    assert single["model"] == "/m" and single["logprobs_mode"] == "processed_logprobs"
    assert single["enable_sleep_mode"] and single["max_model_len"] == 1536 and single["dtype"] == "bfloat16"
    assert single["generation_config"] == "vllm"  # the checkpoint's sampling defaults stay out
    assert "distributed_executor_backend" not in single and "limit_mm_per_prompt" not in single
    many = vllm_llm_kwargs("/m", distributed=True, **{**common, "limit_images": 2})
    assert many["distributed_executor_backend"] == "external_launcher"
    assert many["limit_mm_per_prompt"] == {"image": 2}
    video_model = vllm_llm_kwargs("/m", distributed=False, **{**common, "limit_images": 2}, takes_video=True)
    assert video_model["limit_mm_per_prompt"] == {"image": 2, "video": 0}  # grouprl sends no videos
    # tensor parallelism shards vLLM over the training processes: several of them, never one
    sharded = vllm_llm_kwargs("/m", distributed=True, **{**common, "tensor_parallel_size": 2})
    assert sharded["tensor_parallel_size"] == 2 and sharded["distributed_executor_backend"] == "external_launcher"
    with pytest.raises(ValueError, match="tensor_parallel_size=2 shards vLLM over training processes"):
        vllm_llm_kwargs("/m", distributed=False, **{**common, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        vllm_llm_kwargs("/m", distributed=False, **{**common, "max_num_batched_tokens": 1024})
    assert vllm_llm_kwargs("/m", distributed=False,
                           **{**common, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vllm_llm_kwargs("/m", distributed=False, **{**common, "gpu_memory_utilization": 1.0})


def test_dtype_follows_the_run(paths):
    model, _, _ = load_model_and_processor(paths["lm"])
    assert vllm_dtype("bfloat16") == "bfloat16" and vllm_dtype("float32") == "float32"
    assert vllm_dtype("auto", model) in ("float32", "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        vllm_dtype("int8")


def test_prompts_carry_one_placeholder_per_image(vlm):
    model, processor = vlm
    samples = vlm_samples()
    ids, mask, _ = encode_prompts(processor, samples)
    rows = unpadded_rows(ids, mask)
    image_id = model.config.image_token_id
    for sample, row in zip(samples, rows):
        prompt = vllm_prompt(row, sample.images, image_token_id=image_id)
        # exactly what the chat template renders before the processor expands the images
        template_ids = processor.tokenizer(render_prompt(processor, sample), add_special_tokens=False)["input_ids"]
        assert prompt["prompt_token_ids"] == template_ids
        assert prompt["prompt_token_ids"].count(image_id) == len(sample.images)
        if sample.images:
            assert row.count(image_id) > len(sample.images)  # grouprl's own ids are expanded
            assert prompt["multi_modal_data"] == {"image": list(sample.images)}
        else:
            assert "multi_modal_data" not in prompt and prompt["prompt_token_ids"] == row
    assert collapse_image_placeholders([1, 7, 7, 7, 2, 7, 7, 3], 7) == [1, 7, 2, 7, 3]
    assert collapse_image_placeholders([1, 7, 7], None) == [1, 7, 7]


def test_image_checks(vlm):
    model, processor = vlm
    samples = vlm_samples()
    ids, mask, inputs = encode_prompts(processor, samples)
    rows = unpadded_rows(ids, mask)
    image_id = model.config.image_token_id
    check_prompt_images(samples, rows, inputs, image_token_id=image_id, limit_images=2)
    with pytest.raises(ValueError, match="limit_images=1"):
        check_prompt_images(samples, rows, inputs, image_token_id=image_id, limit_images=1)
    missing = [Sample(messages=s.messages, images=s.images[:1], index=s.index) if len(s.images) == 2 else s
               for s in samples]
    with pytest.raises(ValueError, match="placeholders .* for 2 image"):
        check_prompt_images(missing, rows, [{}] * 3, image_token_id=image_id)
    with pytest.raises(ValueError, match="encoded prompt holds 2"):
        check_prompt_images(missing, rows, inputs, image_token_id=image_id)

    # grouprl's processor-vs-model image-token check, before the first rollout
    assert check_images_once(processor, model, samples)
    assert not check_images_once(processor, model, samples[2:])
    broken = copy.deepcopy(model.config)
    broken.image_token_id = model.config.image_token_id + 1  # the model would look for another token
    with pytest.raises(ValueError, match="image token"):
        check_images_once(processor, broken, samples)


# ---------------------------------------------------------------------------- vLLM outputs -> RolloutBatch


def test_response_tensors_match_the_hf_engine():
    pad, eos = 0, [7, 8]
    rows = [[4, 5, 7], [4, 8, 9, 9], [5, 5, 5, 5, 5], [7]]
    ids, mask, truncated = response_tensors(rows, eos, pad)
    # the hf engine's _finish on the same tokens, right-padded the way generate pads finished rows
    width = max(len(r) for r in rows)
    padded = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    hf_ids, hf_mask, hf_truncated = HFGenerationEngine._finish(
        SimpleNamespace(pad_token_id=pad, eos_token_ids=eos), [padded])
    assert torch.equal(ids, hf_ids) and torch.equal(mask, hf_mask) and torch.equal(truncated, hf_truncated)
    assert truncated.tolist() == [False, False, True, False]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert ids[1].tolist() == [4, 8, 0, 0, 0]  # tokens after the first EOS are padding
    ids, mask, truncated = response_tensors([[], [7]], eos, pad)
    assert mask.tolist() == [[0], [1]] and truncated.tolist() == [True, False]


@pytest.mark.parametrize("return_log_probs", [True, False])
def test_vllm_outputs_become_the_hf_engines_batch(vlm, return_log_probs):
    """Rows sampled by the hf engine, handed over in vLLM's output shape, give the same RolloutBatch."""
    model, processor = vlm
    samples = vlm_samples()
    n = 3
    engine = HFGenerationEngine(model, processor)
    params = SamplingParams(n=n, max_new_tokens=8, seed=5, return_log_probs=return_log_probs)
    hf = engine.generate(samples, params)
    assert hf.truncated.any() and (~hf.truncated).any()  # both kinds of rows are exercised
    ids, mask, inputs = encode_prompts(processor, samples)
    expanded = unpadded_rows(ids, mask)
    outputs = as_vllm_outputs(hf, n, prompt_token_ids=expanded, shuffle_completions=True)
    got = rollout_batch_from_vllm(outputs, samples=samples, prompt_ids=ids, prompt_mask=mask, model_inputs=inputs,
                                  n=n, eos_token_ids=engine.eos_token_ids, pad_token_id=engine.pad_token_id,
                                  tokenizer=processor, return_log_probs=return_log_probs)
    for name in ("group_index", "prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated",
                 "loss_mask", "edited"):
        assert torch.equal(getattr(got, name), getattr(hf, name)), name
    assert got.responses == hf.responses
    assert [s.index for s in got.samples] == [s.index for s in hf.samples]
    assert len(got.model_inputs) == len(hf.model_inputs)
    for a, b in zip(got.model_inputs, hf.model_inputs):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if return_log_probs:
        assert torch.allclose(got.rollout_log_probs, hf.rollout_log_probs)
        assert (got.rollout_log_probs[got.response_mask == 0] == 0).all()
    else:
        assert got.rollout_log_probs is None


def test_vllm_outputs_are_checked(vlm):
    _, processor = vlm
    samples = vlm_samples()[2:]  # the text-only prompt
    ids, mask, inputs = encode_prompts(processor, samples)
    prompt = unpadded_rows(ids, mask)[0]
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    kwargs = dict(samples=samples, prompt_ids=ids, prompt_mask=mask, model_inputs=inputs, n=2,
                  eos_token_ids=[eos], pad_token_id=0, tokenizer=processor, return_log_probs=True)

    def out(prompt_ids=prompt, reasons=("stop", "length"), logprobs=True, count=2):
        completions = []
        for j in range(count):
            tokens = [11, 12, eos] if reasons[j % 2] == "stop" else [11, 12, 13, 14]
            lps = [{t: Logprob(-0.5 - k)} for k, t in enumerate(tokens)] if logprobs else None
            completions.append(CompletionOutput(index=j, token_ids=tokens, logprobs=lps, finish_reason=reasons[j % 2]))
        return [RequestOutput(prompt_token_ids=prompt_ids, outputs=completions)]

    batch = rollout_batch_from_vllm(out(), **kwargs)
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]] and batch.truncated.tolist() == [False, True]
    assert batch.rollout_log_probs.tolist() == [[-0.5, -1.5, -2.5, 0.0], [-0.5, -1.5, -2.5, -3.5]]
    # the collapsed prompt vLLM was given is accepted as what it reports
    rollout_batch_from_vllm(out(prompt_ids=[1, 2]), **kwargs, sent_prompts=[[1, 2]])
    with pytest.raises(ValueError, match="vLLM ran a prompt of"):
        rollout_batch_from_vllm(out(prompt_ids=prompt + [5]), **kwargs)
    with pytest.raises(ValueError, match="expected n=2"):
        rollout_batch_from_vllm(out(count=1), **kwargs)
    with pytest.raises(RuntimeError, match="abort"):
        rollout_batch_from_vllm(out(reasons=("abort", "stop")), **kwargs)
    with pytest.raises(ValueError, match="no log-probs"):
        rollout_batch_from_vllm(out(logprobs=False), **kwargs)
    with pytest.raises(ValueError, match="2 outputs for 1 prompts"):
        rollout_batch_from_vllm(out() * 2, **kwargs)


# ---------------------------------------------------------------------------- the model inside vllm.LLM


def test_vllm_model_path_lookup():
    class Model(torch.nn.Module):
        def load_weights(self, weights):
            return set()

    model = Model()
    v024 = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))))))
    trl_path = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model)))))
    assert vllm_model(v024) is model and vllm_model(trl_path) is model
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        vllm_model(SimpleNamespace(llm_engine=SimpleNamespace(model_executor=None)))


class Recorder:
    """Stands in for vllm.LLM's sleep / wake_up / cache resets only: records the order of calls."""

    def __init__(self, model):
        self.calls = []
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))),
            reset_encoder_cache=lambda: self.calls.append(("reset_encoder_cache",)))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def bare_engine(policy, processor, sleep_level=1):
    """A VLLMEngine without a vllm.LLM: its sleep/wake bookkeeping and weight sync, on a recorder."""
    engine = object.__new__(VLLMEngine)
    engine.model, engine.processor = policy, processor
    engine.enable_sleep_mode, engine.sleep_level = True, sleep_level
    engine._asleep, engine._weights_discarded = set(), False
    engine.weight_sync_path = "load_weights"  # what a CUDA vLLM gets
    return engine


def test_update_weights_wakes_the_weights_sends_checkpoint_names_and_resets_the_cache(paths):
    from safetensors.torch import load_file

    model, tokenizer, _ = load_model_and_processor(paths["vlm"])
    policy = apply_lora(model, rank=2, alpha=4)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    received = {}

    class Sink(torch.nn.Module):
        def load_weights(self, weights):
            for name, tensor in weights:
                received[name] = tensor
            return set(received)

    engine = bare_engine(policy, tokenizer)
    engine.llm = Recorder(Sink())
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    from grouprl.trainer.parallel import full_named_parameters

    engine.update_weights(full_named_parameters(policy))
    engine.wake_up()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("reset_prefix_cache",),
                                ("reset_encoder_cache",), ("wake_up", ("kv_cache",))]
    on_disk = load_file(str(paths["vlm"] / "model.safetensors"))
    assert set(received) == set(on_disk)  # checkpoint names, LoRA merged, nothing else
    expected = dict(named_weights_for_sync(policy))
    assert all(torch.equal(received[k], expected[k]) for k in received)


def test_level_two_sleep_requires_a_weight_update_before_generating(paths):
    model, tokenizer, _ = load_model_and_processor(paths["lm"])

    class Partial(torch.nn.Module):  # a vLLM model whose load_weights reports one parameter not reloaded
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(1))
            self.b = torch.nn.Parameter(torch.zeros(1))

        def load_weights(self, weights):
            for _ in weights:
                pass
            return {"a"}

    engine = bare_engine(model, tokenizer, sleep_level=2)
    engine.llm = Recorder(Partial())
    engine.sleep()
    assert engine._weights_discarded
    with pytest.raises(RuntimeError, match="level 2"):
        engine.generate([], SamplingParams())
    with pytest.raises(RuntimeError, match="not reloaded"):
        engine.update_weights(gathered_named_parameters(model))


# ---------------------------------------------------------------------------- what the running vLLM can do


def fake_llm(model, runner_extra=None):
    runner = SimpleNamespace(model=model, **(runner_extra or {}))
    return SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(model_runner=runner))))


class FakeOutputLayer(torch.nn.Module):
    def __init__(self, packed: bool):
        super().__init__()
        self.repacked = 0
        if packed:
            self.cpu_linear = lambda *args: None
        self.quant_method = SimpleNamespace(process_weights_after_loading=self._repack)

    def _repack(self, layer):
        assert layer is self
        self.repacked += 1


class FakeVLLMModel(torch.nn.Module):
    """vLLM's model shape where it matters here: linear layers packed or not, an output layer inside a
    language model (as a VLM's), tied embeddings or not."""

    def __init__(self, *, packed: bool, tied: bool):
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=tied)
        self.language_model = torch.nn.Module()
        self.language_model.lm_head = FakeOutputLayer(packed)
        self.loaded = []

    def load_weights(self, weights):
        self.loaded = [name for name, _ in weights]
        return set(self.loaded)


def test_weight_sync_path_is_chosen_by_what_the_loaded_model_is():
    from grouprl.rollout.vllm_capabilities import load_weights, weight_sync_path

    plain = FakeVLLMModel(packed=False, tied=True)
    assert weight_sync_path(fake_llm(plain)) == "load_weights"
    assert load_weights(fake_llm(plain), [("w", torch.zeros(1))]) == {"w"} and plain.loaded == ["w"]
    assert plain.language_model.lm_head.repacked == 0

    packed = FakeVLLMModel(packed=True, tied=True)
    reloads = []
    llm = fake_llm(packed, {"reload_weights": lambda weights_iterator: reloads.append(list(weights_iterator))})
    assert weight_sync_path(llm) == "reload_weights"
    assert load_weights(llm, [("w", torch.zeros(1))]) is None
    assert [name for name, _ in reloads[0]] == ["w"] and packed.loaded == []
    # the tied output layer inside the language model is repacked from the reloaded embedding
    assert packed.language_model.lm_head.repacked == 1

    untied = FakeVLLMModel(packed=True, tied=False)
    load_weights(fake_llm(untied, {"reload_weights": lambda weights_iterator: list(weights_iterator)}), [])
    assert untied.language_model.lm_head.repacked == 0

    with pytest.raises(RuntimeError, match="no reload_weights"):
        weight_sync_path(fake_llm(FakeVLLMModel(packed=True, tied=True)))


def test_an_update_resets_the_prefix_and_the_encoder_caches():
    from grouprl.rollout.vllm_capabilities import reset_caches_after_update

    calls = []
    llm = SimpleNamespace(reset_prefix_cache=lambda: calls.append("prefix"),
                          llm_engine=SimpleNamespace(reset_encoder_cache=lambda: calls.append("encoder")))
    reset_caches_after_update(llm)
    assert calls == ["prefix", "encoder"]
