"""On-policy distillation's teacher (``algorithm.teacher``): loaded frozen, checked against the student's
tokenizer, moved off the accelerator between uses when asked; and the step's distillation advantages.

The teacher scores the student's own sampled tokens: its log-probs come from the same experience
micro-batches, at the same temperature, as the student's old log-probs (``GRPOTrainer._log_probs``),
padding-free and chunked paths included. The per-token advantage is
``grouprl.algorithms.distillation.reverse_kl_advantages``, added to the rewards' advantage with
``algorithm.distill_coef``.
"""

from __future__ import annotations

import torch

from grouprl.algorithms.distillation import mix_advantages, reverse_kl_advantages
from grouprl.config import ConfigError, TeacherConfig
from grouprl.models.frozen import FrozenModel
from grouprl.models.inputs import tokenizer_of
from grouprl.trainer.metrics import StepMetrics

KEY = "algorithm.teacher.model_path"

# the special tokens whose ids a generation or a chat template relies on
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_difference(student, teacher) -> str | None:
    """How the teacher's tokenizer differs from the student's, in a few words, or None when they agree.

    The teacher is fed the student's token ids and scores the student's sampled ids, so both must
    map every id to the same token: same vocabulary (token -> id, added tokens included) and the
    same special tokens. (Processors: their tokenizers are compared.)
    """
    student, teacher = tokenizer_of(student), tokenizer_of(teacher)
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        if len(s_vocab) != len(t_vocab):
            return f"vocabulary of {len(t_vocab)} tokens, the student's has {len(s_vocab)}"
        token = next(tok for tok in sorted(s_vocab) if t_vocab.get(tok) != s_vocab[tok])
        return (f"token {token!r} is id {t_vocab.get(token)} in the teacher's vocabulary and "
                f"{s_vocab[token]} in the student's")
    for name in SPECIAL_TOKENS:
        s_token, t_token = getattr(student, name, None), getattr(teacher, name, None)
        if s_token != t_token:
            return f"{name} {t_token!r}, the student's is {s_token!r}"
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        extra = sorted(set(teacher.all_special_tokens) ^ set(student.all_special_tokens))
        return f"special tokens differ ({', '.join(map(repr, extra[:5]))})"
    return None


class Teacher(FrozenModel):
    """A frozen model (``requires_grad`` False, eval mode) that scores the student's samples.

    ``offload``: the weights live on the CPU and visit ``device`` for each use (:meth:`on_device`).
    """

    @classmethod
    def load(cls, config: TeacherConfig, *, student_processor, frozen_dtype: torch.dtype,
             device: torch.device | str) -> "Teacher":
        """The teacher ``config`` names, in ``config.dtype`` (auto: ``frozen_dtype``, the run's dtype for
        frozen weights). ConfigError naming ``algorithm.teacher.model_path`` when it cannot load or its
        tokenizer is not the student's."""
        from grouprl.models.loading import load_model_and_processor

        dtype = frozen_dtype if config.dtype == "auto" else config.dtype
        try:
            model, processor, _ = load_model_and_processor(config.model_path, dtype=dtype,
                                                           trust_remote_code=config.trust_remote_code)
        except Exception as exc:  # noqa: BLE001 -- any loading failure is this key's: say which and why
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"config key '{KEY}': the teacher {config.model_path!r} could not be loaded: "
                              f"{reason}") from exc
        difference = tokenizer_difference(student_processor, processor)
        if difference is not None:
            raise ConfigError(f"config key '{KEY}': the teacher {config.model_path!r} has another tokenizer than "
                              f"the student's ({difference}); distillation scores the student's token ids, "
                              "so the two must share one")
        return cls(model, device=device, offload=config.offload)


def distillation_advantages(reward_advantages: torch.Tensor | None, teacher_log_probs: torch.Tensor,
                            old_log_probs: torch.Tensor, loss_mask: torch.Tensor, distill_coef: float,
                            metrics: StepMetrics) -> torch.Tensor:
    """A = A_rewards + c * (t - s) per token (``mix_advantages``; no reward: c * (t - s) alone), with
    ``distill/reverse_kl`` (token mean of s - t, the single-sample reverse KL) and
    ``distill/advantage_mean`` (token mean of c * (t - s), what distillation adds to A) recorded."""
    distill = reverse_kl_advantages(teacher_log_probs, old_log_probs, loss_mask)
    mask = loss_mask != 0
    tokens = float(mask.sum())
    mean = float(distill[mask].mean()) if tokens else 0.0
    metrics.mean("distill/reverse_kl", -mean, tokens)
    metrics.mean("distill/advantage_mean", distill_coef * mean, tokens)
    return mix_advantages(reward_advantages, distill, distill_coef)
