"""On-policy distillation (``algorithm.teacher``, grouprl.algorithms.distillation, grouprl.trainer.teacher):
the per-token reverse-KL advantage against verl's and, in expectation over the student's samples, against
TRL's exact reverse KL (value and gradient); the teacher's log-probs in the trainer's micro-batches; tiny
runs with rewards and without; the teacher frozen and offloaded; a teacher that cannot load or has another
tokenizer refused with one line and exit code 2."""

from __future__ import annotations

import pytest
import torch
import yaml

from grouprl.algorithms import compute_policy_loss, kl_penalty
from grouprl.algorithms.distillation import mix_advantages, reverse_kl_advantages
from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer.metrics import StepMetrics

WORDS = ("yes", "no", "maybe", "left", "right", "up", "down")  # the say_task's words (tests/conftest.py)
REPEATS = 6


# ---------------------------------------------------------------------------- the advantage


def test_reverse_kl_advantage_is_teacher_minus_student_and_zero_where_masked():
    s = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -3.0, -1.0]])
    t = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, float("inf"), -2.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    a = reverse_kl_advantages(t, s, m)
    assert torch.equal(a, torch.tensor([[-0.5, 1.0, 0.0], [0.0, 0.0, -1.0]]))
    with pytest.raises(ValueError, match="same shape"):
        reverse_kl_advantages(t[:, :2], s, m)


def verl_distillation_advantages(student_log_probs, teacher_log_probs):
    """verl 0.9.1, verl/trainer/distillation/losses.py: ``compute_distillation_loss_reverse_kl_estimator``
    (loss_mode "k1": ``kl_penalty(logprob=student, ref_logprob=teacher, "k1")`` = student - teacher) and
    ``distillation_loss`` with ``use_policy_gradient``: ``advantages=-distillation_losses.detach()``."""
    distillation_losses = student_log_probs - teacher_log_probs  # core_algos.kl_penalty, "k1"
    return -distillation_losses.detach()


def test_reverse_kl_advantage_matches_verls_policy_gradient_distillation():
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    t = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    m = torch.ones(4, 6)
    torch.testing.assert_close(reverse_kl_advantages(t, s, m), verl_distillation_advantages(s, t), rtol=0, atol=1e-12)
    # grouprl's own k1 estimator is the same quantity with the opposite sign
    torch.testing.assert_close(reverse_kl_advantages(t, s, m), -kl_penalty(s, t, "k1"), rtol=0, atol=1e-12)


def test_mix_adds_the_weighted_distillation_advantage_or_is_it_alone_without_rewards():
    rewards, distill = torch.tensor([[1.0, 1.0]]), torch.tensor([[0.5, -2.0]])
    assert torch.equal(mix_advantages(rewards, distill, 0.5), torch.tensor([[1.25, 0.0]]))
    assert torch.equal(mix_advantages(rewards, distill, 0.0), rewards)
    assert torch.equal(mix_advantages(None, distill, 2.0), torch.tensor([[1.0, -4.0]]))


def test_distillation_advantages_record_the_token_mean_reverse_kl():
    from grouprl.trainer.teacher import distillation_advantages

    s = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -1.0, -1.0]])
    t = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -3.0, -2.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    metrics = StepMetrics()
    a = distillation_advantages(torch.ones(2, 3), t, s, m, 0.5, metrics)
    torch.testing.assert_close(a, torch.ones(2, 3) + 0.5 * torch.where(m.bool(), t - s, torch.zeros(2, 3)))
    kl = float(((s - t) * m).sum() / m.sum())  # (0.5 - 1 + 0 + 2 + 1) / 5
    logged = metrics.local()
    assert logged["distill/reverse_kl"] == pytest.approx(kl)
    assert logged["distill/advantage_mean"] == pytest.approx(-0.5 * kl)


# ---------------------------------------------------------------------------- against TRL's exact reverse KL


def expected_grouprl_loss(student_logits, teacher_logits, mask):
    """sum_y s(y) * (grouprl's policy loss of token y at every position): the expectation over y ~ student of
    the loss grouprl trains with (vanilla PPO at ratio 1, token-mean), its advantage reverse_kl_advantages."""
    log_s = torch.log_softmax(student_logits, -1)
    log_t = torch.log_softmax(teacher_logits, -1)
    old = log_s.detach()
    total = 0
    for y in range(student_logits.shape[-1]):
        advantage = reverse_kl_advantages(log_t[..., y], old[..., y], mask)
        loss, _ = compute_policy_loss("vanilla", log_s[..., y], old[..., y], advantage, mask,
                                      clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean",
                                      token_weights=old[..., y].exp())  # the weight s(y) of sampling y
        total = total + loss
    return total


def direct_reverse_kl(student_logits, teacher_logits, mask):
    """The hand-written formula: mean over valid positions of sum_y s(y) (log s(y) - log t(y))."""
    log_s = torch.log_softmax(student_logits, -1)
    log_t = torch.log_softmax(teacher_logits, -1)
    per_position = (log_s.exp() * (log_s - log_t)).sum(-1)
    return (per_position * mask).sum() / mask.sum()


def test_expected_loss_and_gradient_equal_trls_exact_reverse_kl():
    """TRL's on-policy distillation (``DistillationTrainer``, beta=1: reverse KL) differentiates the exact
    per-position KL(student || teacher) over the vocabulary; grouprl's per-token advantage is its
    single-sample estimate. Enumerating the vocabulary, the expectation of grouprl's loss over y ~ student
    equals TRL's loss, and its gradient TRL's gradient (w.r.t. the student's output weights)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(3)
    batch, positions, hidden, vocab = 2, 4, 6, 9
    h_s = torch.randn(batch, positions, hidden, generator=g, dtype=torch.float64)
    h_t = torch.randn(batch, positions, hidden, generator=g, dtype=torch.float64)
    w_s = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).requires_grad_(True)
    w_t = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])

    trl_loss, _, n_valid = _chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta=1.0)
    (trl_grad,) = torch.autograd.grad(trl_loss, w_s)
    ours = expected_grouprl_loss(h_s @ w_s.T, h_t @ w_t.T, mask)
    (our_grad,) = torch.autograd.grad(ours, w_s)
    direct = direct_reverse_kl(h_s @ w_s.T, h_t @ w_t.T, mask)
    (direct_grad,) = torch.autograd.grad(direct, w_s)

    assert int(n_valid) == 5
    # float64 throughout: grouprl's expectation is the exact formula's value and gradient
    torch.testing.assert_close(ours, direct, rtol=0, atol=1e-12)
    torch.testing.assert_close(our_grad, direct_grad, rtol=0, atol=1e-12)
    # TRL's kernel projects and reduces in float32 whatever the inputs' dtype: a float32 tolerance
    torch.testing.assert_close(ours, trl_loss.to(torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(our_grad, trl_grad.to(torch.float64), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the tokenizer check


def test_tokenizer_difference_names_the_vocabulary_and_special_tokens():
    from grouprl.models.tiny import build_tokenizer
    from grouprl.trainer.teacher import tokenizer_difference

    corpus = ["Say yes 1", "Say no 2", "yes no maybe"]
    a, b = build_tokenizer(corpus), build_tokenizer(corpus)
    assert tokenizer_difference(a, b) is None
    other = build_tokenizer(corpus + ["an entirely different corpus of words"])
    assert "vocabulary of" in tokenizer_difference(a, other)
    b.eos_token = b.bos_token
    assert "eos_token" in tokenizer_difference(a, b)


# ---------------------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def task(say_task):
    return say_task(REPEATS)


@pytest.fixture(scope="module")
def teacher_dir(tiny_text_lm):
    """A tiny model with the say_task's tokenizer (the same corpus) and other weights."""
    corpus = [f"Say {w} {i}" for i in range(REPEATS) for w in WORDS] + list(WORDS)
    return tiny_text_lm(corpus, seed=1)


def distill_config(task, out, teacher, rewards=({"name": "accuracy"},), **overrides) -> dict:
    return task.config(out, list(rewards), **{
        "algorithm.teacher.model_path": str(teacher), "worker.actor.global_batch_size": 4,
        "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.actor.micro_batch_size_per_device_for_experience": 16, "trainer.seed": 3, **overrides})


def teacher_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.teacher.model.state_dict().items()}


def test_rewards_plus_distillation_trains_the_student_and_never_the_teacher(task, teacher_dir, tmp_path,
                                                                          monkeypatch, read_jsonl):
    """Two steps with a reward and distill_coef 0.5, padding-free and chunked: the teacher's log-probs are
    those of a plain padded forward at the rollout temperature, the advantages the rewards' plus half the
    distillation's; the teacher is frozen and unchanged."""
    from grouprl.rollout.logprobs import compute_log_probs
    from grouprl.trainer import teacher as teacher_module
    from grouprl.trainer.grpo import GRPOTrainer

    config = config_from_dict(distill_config(task, tmp_path / "run", teacher_dir, **{
        "algorithm.distill_coef": 0.5, "worker.rollout.temperature": 0.7, "worker.actor.padding_free": True,
        "worker.actor.log_prob_chunk_tokens": 3, "worker.actor.micro_batch_size_per_device_for_experience": 3}))
    trainer = GRPOTrainer(config)
    assert all(not p.requires_grad for p in trainer.teacher.model.parameters()) and not trainer.teacher.model.training
    before = teacher_state(trainer)
    seen = []
    original = teacher_module.distillation_advantages

    def spy(reward_advantages, teacher_log_probs, old_log_probs, loss_mask, coef, metrics):
        mixed = original(reward_advantages, teacher_log_probs, old_log_probs, loss_mask, coef, metrics)
        seen.append((reward_advantages.clone(), teacher_log_probs.clone(), old_log_probs.clone(), loss_mask.clone(),
                     coef, mixed.clone()))
        return mixed

    batches = []
    monkeypatch.setattr(teacher_module, "distillation_advantages", spy)
    step = trainer.step
    monkeypatch.setattr(trainer, "step", lambda k: batches.append(result := step(k)) or result)
    final = trainer.train()

    assert len(seen) == 2
    for (reward_adv, teacher_lp, old_lp, mask, coef, mixed), result in zip(seen, batches):
        assert coef == 0.5
        with torch.no_grad():
            plain, _ = compute_log_probs(trainer.teacher.model, result.batch, micro_batch_size=64, temperature=0.7,
                                         chunk_tokens=None)
        torch.testing.assert_close(teacher_lp * mask, plain * mask, rtol=0, atol=1e-5)
        torch.testing.assert_close(mixed, reward_adv + 0.5 * torch.where(mask.bool(), teacher_lp - old_lp, 0.0))
    for key in ("distill/reverse_kl", "distill/advantage_mean", "reward/mean", "rewards/accuracy/mean"):
        assert key in final, key
    after = teacher_state(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "the teacher changed"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all("distill/reverse_kl" in r for r in rows)


def test_pure_distillation_without_rewards_trains_on_the_teacher_alone(task, teacher_dir, tmp_path, read_jsonl,
                                                                      monkeypatch):
    """No reward and one response per prompt: the advantages are the distillation's alone (A = A^distill),
    the student trains, the teacher does not, and no reward metric is logged."""
    from grouprl.trainer import teacher as teacher_module
    from grouprl.trainer.grpo import GRPOTrainer

    config = config_from_dict(distill_config(task, tmp_path / "run", teacher_dir, rewards=(),
                                             **{"worker.rollout.n": 1}))
    trainer = GRPOTrainer(config)
    assert trainer.rewards is None
    seen = []
    original = teacher_module.distillation_advantages
    monkeypatch.setattr(teacher_module, "distillation_advantages",
                        lambda *args: seen.append(args[:5]) or original(*args))
    student = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    teacher = teacher_state(trainer)
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert not [k for k in rows[0] if k.startswith(("reward", "frac_reward"))]
    assert all(r["distill/advantage_mean"] == pytest.approx(-r["distill/reverse_kl"]) for r in rows)
    assert all(r["distill/reverse_kl"] > 0 for r in rows)  # two different models
    assert len(seen) == 2 and all(args[0] is None and args[4] == 1.0 for args in seen)
    assert any(not torch.equal(student[k], v) for k, v in trainer.policy.named_parameters()), "the student is unchanged"
    after = teacher_state(trainer)
    assert all(torch.equal(teacher[k], after[k]) for k in teacher), "the teacher changed"
    records = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert len(records) == 2 * 4 and all(r["rewards"] == {} for r in records)


def test_offloaded_teacher_visits_the_device_for_each_forward_only(task, teacher_dir, tmp_path, monkeypatch):
    from grouprl.trainer.grpo import GRPOTrainer
    from grouprl.trainer.teacher import Teacher

    moves: list[str] = []
    to = torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        if isinstance(module, torch.nn.Module) and getattr(module, "_is_teacher", False):
            moves.append(str(args[0]))
        return to(module, *args, **kwargs)

    load = Teacher.load.__func__

    def marked_load(cls, *args, **kwargs):
        made = load(cls, *args, **kwargs)
        made.model._is_teacher = True
        return made

    monkeypatch.setattr(Teacher, "load", classmethod(marked_load))
    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    config = config_from_dict(distill_config(task, tmp_path / "run", teacher_dir, **{
        "algorithm.teacher.offload": True, "trainer.max_steps": 1}))
    trainer = GRPOTrainer(config)
    assert trainer.teacher.offload
    moves.clear()
    trainer.train()
    assert moves == [str(trainer.accelerator.device), "cpu"]  # there for its forward, back after it
    assert all(p.device.type == "cpu" for p in trainer.teacher.model.parameters())


def test_teacher_in_bf16_where_the_run_computes_in_bf16(task, teacher_dir, tmp_path):
    from grouprl.trainer.grpo import GRPOTrainer

    config = config_from_dict(distill_config(task, tmp_path / "run", teacher_dir,
                                             **{"worker.actor.model.dtype": "bfloat16", "trainer.max_steps": 1}))
    trainer = GRPOTrainer(config)
    assert {p.dtype for p in trainer.teacher.model.parameters()} == {torch.bfloat16}
    assert "distill/reverse_kl" in trainer.train()


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides, named", [
    ({"algorithm.distill_coef": 0.5}, "no teacher is set"),
    ({"algorithm.teacher.model_path": "{teacher}", "algorithm.distill_coef": -1.0}, "algorithm.distill_coef"),
    ({"algorithm.teacher.model_path": "{teacher}", "worker.reward.functions": [], "algorithm.distill_coef": 0.0},
     "nothing would train"),
    ({"algorithm.teacher.model_path": "{teacher}", "worker.reward.functions": [],
      "algorithm.online_filtering": True}, "algorithm.online_filtering"),
    ({"worker.rollout.n": 1}, "worker.rollout.n"),  # rewards and GRPO: still a group of at least 2
])
def test_distillation_config_errors_name_the_key(task, teacher_dir, tmp_path, overrides, named):
    overrides = {k: (str(teacher_dir) if v == "{teacher}" else v) for k, v in overrides.items()}
    values = task.config(tmp_path / "run", [{"name": "accuracy"}], **overrides)
    with pytest.raises(ConfigError, match=named):
        config_from_dict(values)


@pytest.fixture(scope="module")
def cli_teachers(tmp_path_factory, tiny_text_lm, teacher_dir):
    """A teacher with another tokenizer, and one whose weights file is cut short."""
    import shutil

    root = tmp_path_factory.mktemp("teachers")
    other = tiny_text_lm(["Completely other words", "for another tokenizer", "entirely"], seed=2)
    broken = root / "broken"
    shutil.copytree(teacher_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return {"other": other, "broken": broken, "missing": root / "no_such_teacher"}


@pytest.mark.parametrize("which, named", [
    ("other", "has another tokenizer than the student's (vocabulary of"),
    ("broken", "could not be loaded"),
    ("missing", "could not be loaded: model path"),
])
def test_a_teacher_that_cannot_serve_is_one_line_and_exit_code_2(task, teacher_dir, cli_teachers, tmp_path,
                                                                 capsys, which, named):
    from transformers.utils import logging as hf_logging

    from grouprl.cli import main

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(distill_config(task, tmp_path / "run", cli_teachers[which])))
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar is not an error line
    try:
        assert main(["train", str(path)]) == 2
    finally:
        hf_logging.enable_progress_bar()
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("grouprl: config error: config key 'algorithm.teacher.model_path'"), err[0]
    assert named in err[0] and str(cli_teachers[which]) in err[0], err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
