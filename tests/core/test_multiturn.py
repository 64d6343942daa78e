"""Verifier-guided dialogues in token space: what the policy was conditioned on is what it is trained on."""

from __future__ import annotations

import pytest
import torch

from grouprl.config import VerifierConfig
from grouprl.models.loading import load_model_and_processor
from grouprl.models.inputs import encode_prompts, end_of_turn_id, forward_kwargs, tokenizer_of
from grouprl.rollout.engine import SamplingParams
from grouprl.rollout.hf_engine import HFGenerationEngine
from grouprl.rollout.logprobs import compute_log_probs
from grouprl.rollout.multiturn import MultiTurnRollout, problem_text, turn_boundary_ids
from grouprl.rollout.verifier import Verifier, VerifierRequest

from test_engine import samples, text_samples, with_eos_bias  # helpers (`paths`: tests/conftest.py)


class ScriptedVerifier(Verifier):
    """Replies from a script, by how many turns the dialogue has: the dialogue logic under test, not a model."""

    backend = "scripted"

    def __init__(self, script: dict[int, str], **config):
        super().__init__(VerifierConfig(enable=True, backend="rule", **config))
        self.script = script
        self.seen: list[VerifierRequest] = []

    def _reply_many(self, requests):
        self.seen.extend(requests)
        return [self._reply(self.script.get(len(r.turns), "Keep going. [SCORE] hallucination_detect=1"))
                for r in requests]


def engine_for(paths, name):
    model, processor, _ = load_model_and_processor(paths[name])
    # EOS comes often enough for turns to end, not at once
    with_eos_bias(model, tokenizer_of(processor).convert_tokens_to_ids("<|im_end|>"), probability=0.25)
    model.eval()
    return model, processor, HFGenerationEngine(model, processor)


class SpyEngine:
    """Passes every call to the real engine and keeps the prompts each turn was generated from."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, batch_samples, params, prompts=None):
        self.calls.append(prompts)
        return self.engine.generate(batch_samples, params, prompts=prompts)


def rollout(processor, verifier, **config):
    cfg = VerifierConfig(enable=True, backend="rule", **config)
    return MultiTurnRollout(verifier, processor, cfg, end_of_turn_ids=[end_of_turn_id(processor)])


def test_text_between_turns_is_what_the_chat_template_writes(paths):
    _, processor, _ = load_model_and_processor(paths["lm"])
    tokenizer = tokenizer_of(processor)
    turn = "Left side."
    messages = [{"role": "user", "content": "Heart size?"}, {"role": "assistant", "content": turn},
                {"role": "user", "content": "Check again. Which side?"}]
    whole = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    first = tokenizer(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    sampled = tokenizer(turn, add_special_tokens=False)["input_ids"] + [end_of_turn_id(processor)]
    between = turn_boundary_ids(processor, "Check again. Which side?", after_end_of_turn=True)
    assert first + sampled + between == whole


@pytest.mark.parametrize("scope", ["full_turn", "final_turn"])
@pytest.mark.parametrize("model_name", ["lm", "vlm"])
def test_dialogue_is_trained_on_what_it_was_sampled_from(paths, model_name, scope):
    model, processor, engine = engine_for(paths, model_name)
    spy = SpyEngine(engine)
    verifier = ScriptedVerifier({1: "Not yet: check the left side. [SCORE] hallucination_detect=0",
                                 2: "###STOP###"})
    multi = rollout(processor, verifier, max_turns=3, train_scope=scope)
    batch_samples = text_samples() if model_name == "lm" else samples()
    params = SamplingParams(n=2, max_new_tokens=5, seed=3, return_log_probs=True)
    batch = multi.generate(spy, batch_samples, params)
    assert len(batch) == 2 * len(batch_samples)
    turns = batch.extras["num_turns"]
    assert max(turns) >= 2, "no dialogue went past its first turn"

    # every later turn was generated from token ids: the first prompt plus the dialogue so far
    first_lengths = encode_prompts(processor, batch_samples)[1].sum(-1)
    later = [p for call in spy.calls[1:] for p in call]
    assert spy.calls[0] is None and later and all(len(p.ids) > int(first_lengths.max()) for p in later)

    # masks: attention on every real token, the policy's only where it sampled
    assert torch.equal(batch.loss_mask, batch.policy_mask)
    assert bool((batch.policy_mask <= batch.response_mask).all())
    for row, spans in enumerate(batch.extras["spans"]):
        for start, end, kind in spans:
            assert bool((batch.policy_mask[row, start:end] == (kind == "policy")).all())
            assert bool(batch.response_mask[row, start:end].all())
        if scope == "full_turn" and len(spans) > 1:
            assert any(kind == "between" for _, _, kind in spans)

    # the trainer's log-probs of the policy's tokens, computed on the assembled sequences (padding,
    # images and M-RoPE positions included), are the sampler's: the conditioning was the same
    with torch.no_grad():
        trained, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    mask = batch.policy_mask.bool()
    torch.testing.assert_close(trained[mask], batch.rollout_log_probs[mask], atol=1e-4, rtol=0)

    # the verifier saw only the policy's turns, the problem with [IMAGE] for images, and the reference
    for request in verifier.seen:
        assert "<|im_start|>" not in "".join(request.turns)
    if model_name == "vlm":
        assert problem_text(batch_samples[0]).startswith("[IMAGE]")


def test_a_multi_turn_vlm_row_scores_alone_as_in_its_padded_batch(paths):
    """M-RoPE over the whole dialogue with its images: one unpadded row gives the batch's log-probs."""
    model, processor, engine = engine_for(paths, "vlm")
    verifier = ScriptedVerifier({1: "Look again at the second image."})
    batch = rollout(processor, verifier, max_turns=2).generate(engine, samples(), SamplingParams(n=2, max_new_tokens=5,
                                                                                                 seed=1))
    with torch.no_grad():
        together, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
        for row in range(len(batch)):
            alone, _ = compute_log_probs(model, batch.select([row]), micro_batch_size=1)
            mask = batch.response_mask[row].bool()
            torch.testing.assert_close(alone[0][mask], together[row][mask], atol=1e-4, rtol=0)
    # and the model's own rope index over the unpadded sequence is what the padded forward used
    row = int(torch.tensor(batch.extras["num_turns"]).argmax())
    grid = batch.model_inputs[row]["image_grid_thw"]

    def positions(ids, attention):
        kwargs = forward_kwargs(model, ids, attention, {"image_grid_thw": grid})
        return model.model.get_rope_index(kwargs["input_ids"], kwargs["mm_token_type_ids"], image_grid_thw=grid,
                                          attention_mask=kwargs["attention_mask"])[0]

    ids = torch.cat([batch.prompt_ids[row][batch.prompt_mask[row].bool()],
                     batch.response_ids[row][batch.response_mask[row].bool()]]).unsqueeze(0)
    padded = torch.cat([batch.prompt_ids[row], batch.response_ids[row]]).unsqueeze(0)
    attention = torch.cat([batch.prompt_mask[row], batch.response_mask[row]]).unsqueeze(0)
    alone = positions(ids, torch.ones_like(ids))
    assert int(alone.max()) < ids.shape[1] - 1  # image tokens share positions: 3-D M-RoPE, not 1-D arange
    assert torch.equal(positions(padded, attention)[..., attention[0].bool()], alone)


def test_stop_needs_a_final_answer_and_turns_are_capped(paths):
    _, processor, engine = engine_for(paths, "lm")
    # STOP after every turn: the random policy never writes <answer>\boxed{}, so it is asked to go on
    verifier = ScriptedVerifier({1: "###STOP###", 2: "###STOP###", 3: "###STOP###"})
    multi = rollout(processor, verifier, max_turns=3)
    batch = multi.generate(engine, text_samples(), SamplingParams(n=2, max_new_tokens=4, seed=2))
    reasons = batch.extras["stop_reason"]
    # turns of 4 tokens are cut off, yet the verifier answers them and the dialogues go on (the seed's way)
    assert set(reasons) == {"max_turns"} and bool(batch.truncated.any())
    continued = [d for d in batch.extras["dialogue"] if len(d) > 1]
    assert continued and all(d[1]["text"] == multi.config.continue_message for d in continued)
    assert multi.last_metrics["multiturn/stop_reason/max_turns"] > 0
    # in validation the verifier gets no reference
    verifier.seen.clear()
    multi.generate(engine, text_samples(), SamplingParams(n=1, max_new_tokens=4, seed=2), validation=True)
    assert verifier.seen and all(r.reference is None for r in verifier.seen)


@pytest.mark.parametrize("credit", ["shared", "mask_fixed"])
def test_turn_credit_decides_whether_turns_before_an_accepted_fix_train(paths, credit, monkeypatch):
    _, processor, engine = engine_for(paths, "lm")
    # a correction after the first turn, STOP after the second: every dialogue is fixed at turn 2
    verifier = ScriptedVerifier({1: "Wrong sign. [SCORE] hallucination_detect=1", 2: "###STOP###"})
    multi = rollout(processor, verifier, max_turns=3, turn_credit=credit)
    # the random policy's turns pass for final answers
    monkeypatch.setattr("grouprl.rollout.verifier.has_final_answer", lambda text: True)
    batch = multi.generate(engine, text_samples(), SamplingParams(n=2, max_new_tokens=4, seed=3))
    assert set(batch.extras["stop_reason"]) == {"stop"} and set(batch.extras["num_turns"]) == {2}
    for row, spans in enumerate(batch.extras["spans"]):
        (first_start, first_end, _), _between, (last_start, last_end, _) = spans
        mask = batch.policy_mask[row]
        # the fix always trains; the turn the verifier did not accept trains only under shared credit
        assert bool(mask[last_start:last_end].all()) and not mask[first_end:last_start].any()
        assert bool(mask[first_start:first_end].all()) == (credit == "shared")
        assert not mask[first_start:first_end].any() or credit == "shared"
    masked = multi.last_metrics["multiturn/masked_turns"]
    assert masked == (1.0 if credit == "mask_fixed" else 0.0)
    # with final_turn the earlier turns never train: mask_fixed would say nothing, so it is refused
    from grouprl.config import ConfigError

    with pytest.raises(ConfigError, match="turn_credit' is mask_fixed, which needs"):
        VerifierConfig(enable=True, backend="rule", train_scope="final_turn", turn_credit="mask_fixed").check()


def test_hallucination_scores_reach_the_rewards(paths):
    _, processor, engine = engine_for(paths, "lm")
    verifier = ScriptedVerifier({1: "Wrong sign. [SCORE] hallucination_detect=0",
                                 2: "Closer. [SCORE] hallucination_detect=1"})  # turn 3: the default, 1
    batch = rollout(processor, verifier, max_turns=3).generate(engine, text_samples(),
                                                                SamplingParams(n=2, max_new_tokens=4, seed=5))
    by_turn = {1: 0.0, 2: 1.0, 3: 1.0}
    for turns, score, reason, dialogue in zip(batch.extras["num_turns"], batch.extras["verifier_hallucination_score"],
                                              batch.extras["stop_reason"], batch.extras["dialogue"]):
        replied = turns  # every turn is answered, one cut off at the token limit too
        expected = sum(by_turn[t] for t in range(1, replied + 1)) / replied if replied else 0.5
        assert score == pytest.approx(expected)
        assert sum(m["role"] == "assistant" for m in dialogue) == turns
    assert len(set(batch.extras["num_turns"])) >= 1


# ---------------------------------------------------------------------------- in the trainer


@pytest.fixture(scope="module")
def arithmetic(text_task):
    records = [{"problem": f"What is {a} plus {b}? Answer as <answer>\\\\boxed{{N}}</answer>.", "answer": str(a + b)}
               for a in range(1, 5) for b in range(1, 4)]
    return text_task(records, ["<answer>\\boxed{7}</answer>", "Not yet correct. Try again?"])


def guided_config(task, out, **extra) -> dict:
    return task.config(out, [{"name": "length", "kwargs": {"target": 3}}], **{
        "data.val_files": [str(task.data)], "data.max_response_length": 5, "data.rollout_batch_size": 2,
        "data.val_max_samples": 2, "worker.actor.global_batch_size": 2, "worker.rollout.n": 2,
        "worker.rollout.verifier": {"enable": True, "backend": "rule", "max_turns": 3}, "trainer.val_freq": 2,
        **extra})


@pytest.mark.parametrize("scope", ["full_turn", "final_turn"])
def test_guided_training_logs_dialogues(arithmetic, tmp_path, scope):
    import json

    from grouprl.config import config_from_dict
    from grouprl.trainer.grpo import GRPOTrainer

    trainer = GRPOTrainer(config_from_dict(guided_config(arithmetic, tmp_path / "run",
                                                         **{"worker.rollout.verifier.train_scope": scope})))
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "actor/pg_loss" in m]
    for m in train:
        assert m["multiturn/turns"] >= 1 and m["verifier/failures"] == 0
        assert sum(m[f"multiturn/stop_reason/{r}"] for r in ("stop", "max_turns", "verifier_failure", "length")) == \
            pytest.approx(1.0)
    assert any("val/reward/mean" in m for m in lines)
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    for r in rollouts:
        assert r["dialogue"][0]["role"] == "assistant" and len(r["spans"]) >= 1
        assert r["num_turns"] == sum(m["role"] == "assistant" for m in r["dialogue"])
        assert 0.0 <= r["verifier_hallucination_score"] <= 1.0
    batch = trainer.last_step.batch
    assert bool((batch.loss_mask <= batch.policy_mask).all())
    if scope == "full_turn" and max(batch.extras["num_turns"]) > 1:
        assert bool((batch.response_mask.sum(-1) > batch.policy_mask.sum(-1)).any())  # verifier text, no loss


def test_guided_run_killed_and_resumed_matches(arithmetic, tmp_path, interrupt_at_step):
    from grouprl.config import config_from_dict
    from grouprl.trainer import checkpoint as ckpt
    from grouprl.trainer.grpo import GRPOTrainer

    steps = {"trainer.max_steps": 3, "trainer.save_freq": 1, "trainer.val_freq": -1}
    full = GRPOTrainer(config_from_dict(guided_config(arithmetic, tmp_path / "full", **steps)))
    full.train()
    killed = GRPOTrainer(config_from_dict(guided_config(arithmetic, tmp_path / "cut", **steps)))
    interrupt_at_step(killed, 3)
    assert ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints").name == "global_step_2"
    resumed = GRPOTrainer(config_from_dict(guided_config(arithmetic, tmp_path / "cut", **steps,
                                                         **{"trainer.resume": "auto"})))
    resumed.train()
    for (name, a), b in zip(full.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name


def test_an_engine_context_holds_the_longest_dialogue():
    from grouprl.rollout.multiturn import TEMPLATE_TOKENS_PER_TURN, dialogue_response_budget

    cfg = VerifierConfig(enable=True, backend="rule", max_turns=3, max_tokens=50)
    assert dialogue_response_budget(100, cfg) == 3 * 100 + 2 * (50 + TEMPLATE_TOKENS_PER_TURN)
    assert dialogue_response_budget(100, VerifierConfig(enable=True, backend="rule", max_turns=1)) == 100
