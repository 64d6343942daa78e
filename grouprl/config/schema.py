"""The run configuration's schema: one dataclass per section, in the EasyR1/verl shape.

Every key a user can write is a field here, with its type, default and (for a closed
set of strings) its ``choices``; the loader (:mod:`grouprl.config.load`) checks values
against them and refuses unknown keys. Checks of one section that need no other live on
the section (``VerifierConfig.check``); checks across sections and against the
registries are in :mod:`grouprl.config.checks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.config.rollout_correction import VERL_PRESET_NAMES


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def choices(*values: str) -> dict:
    """Field metadata for a string key with a closed set of values: ``field(default=..., metadata=choices(...))``.

    The loader refuses any other value with the list (``load._coerce``).
    """
    return {"choices": values}


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    format: str = field(default="auto", metadata=choices("auto", "easyr1", "llava", "swift", "trl"))
    prompt_key: str | None = None
    answer_key: str | None = None
    image_key: str | None = None
    image_dir: str | None = None
    id_key: str = "id"  # the record field that identifies a sample in logs and outputs
    system_prompt: str | None = None
    # a Jinja template file each prompt is rendered through as {{ content }} (EasyR1's format_prompt)
    format_prompt: str | None = None
    # extra variables for the chat template, on every prompt and dialogue turn, e.g. {enable_thinking: false}
    # for Qwen3 (TRL's chat_template_kwargs); a record's own chat_template_kwargs overrides them key by key
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_prompt_length: int = 1024
    max_response_length: int = 512
    rollout_batch_size: int = 8  # prompts per training step
    val_batch_size: int = 64  # prompts per validation generate call
    val_max_samples: int | None = None
    max_samples: int | None = None
    shuffle: bool = True
    seed: int = 1
    skip_bad_records: bool = False


@dataclass
class OverlongConfig:
    """DAPO overlong shaping: linear penalty in the last ``length`` tokens before the limit."""

    enable: bool = False
    length: int = 64
    penalty_factor: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling between the sampler's and the trainer's log-probs (TRL's vLLM correction).

    w = exp(log pi_trainer - log pi_sampler) per token (``level: token``) or summed over the
    response (``sequence``); ``truncate`` clips w to [clip_min, clip_max], ``mask`` zeroes
    it outside; the policy loss of each token is multiplied by w.
    """

    enable: bool | None = None  # None: on when the sampler can differ from the trainer (vllm, one_step_off)
    level: str = field(default="sequence", metadata=choices("token", "sequence"))
    mode: str = field(default="mask", metadata=choices("truncate", "mask"))
    clip_max: float | None = 3.0
    clip_min: float | None = None
    # verl's keys and presets (grouprl.config.rollout_correction; docs/training.md). null = not given;
    # when any is given they replace level / mode / clip_* (which must then keep their defaults).
    preset: str | None = field(default=None, metadata=choices(*VERL_PRESET_NAMES))
    rollout_is: str | None = field(default=None, metadata=choices("token", "sequence"))
    # str first: float() would read "1_5" (IcePop's "lower_upper") as 15; numbers are read back in resolving
    rollout_is_threshold: str | float | None = None  # u (TIS) or "lower_upper" (IcePop); verl's default 2.0
    rollout_is_batch_normalize: bool | None = None
    rollout_rs: str | None = None  # comma list of verl's rejection options (token_k1, seq_mean_k1, ...)
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool | None = None  # old_log_prob := the sampler's; no trainer recompute
    loss_type: str | None = field(default=None, metadata=choices("ppo_clip", "reinforce"))


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (``algorithm.teacher``): any model the Auto classes load, text or
    vision-language, that shares the student's tokenizer; frozen, never trained.

    ``dtype``: auto = the run's frozen dtype (bf16 where the run computes in bf16). ``offload``: kept
    on the CPU between its forwards (moved to the accelerator for each).
    """

    model_path: str | None = None  # None: no teacher, no distillation
    dtype: str = field(default="auto", metadata=choices("auto", "float32", "bfloat16"))
    offload: bool = False
    trust_remote_code: bool = False


@dataclass
class OffPolicySequenceMaskingConfig:
    """DeepSeek-V3.2's off-policy sequence masking (eq. 9): a negative-advantage response is left out of
    the policy loss when its mean log-ratio of sampler to trained policy exceeds ``delta``; null = off."""

    delta: float | None = None


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    # What GRPO divides (R - group mean) by: group (the group's reward std, GRPO), batch (the std of
    # every reward of the step, TRL's scale_rewards: batch), none (Dr. GRPO). None: read from
    # norm_adv_by_std_in_grpo (EasyR1/verl's key: true = group, false = none).
    adv_std_level: str | None = field(default=None, metadata=choices("group", "batch", "none"))
    norm_adv_by_std_in_grpo: bool = True
    # Several rewards (TRL's key): sum_then_normalize sums the weighted rewards, then the estimator
    # normalises the sum; normalize_then_sum (GDPO; verl's adv_estimator: gdpo) runs the estimator
    # on each reward alone, sums the weighted results and renormalises them over the batch.
    multi_objective_aggregation: str = field(default="sum_then_normalize",
                                             metadata=choices("sum_then_normalize", "normalize_then_sum"))
    policy_loss: str = "vanilla"
    # Options of the chosen estimator and loss, by the names their registered options classes
    # declare (grouprl.algorithms: GRPOOptions, PPOClipOptions, ...), e.g. {std_level: batch} or
    # {clip_ratio_high: 0.28}; they override the older keys that set the same option
    # (adv_std_level, gamma, worker.actor.clip_ratio_*, worker.actor.gspo, ...).
    adv_estimator_options: dict[str, Any] = field(default_factory=dict)
    policy_loss_options: dict[str, Any] = field(default_factory=dict)
    loss_agg_mode: str = "token-mean"
    gamma: float = 1.0
    # KL to the reference policy. kl_coef > 0 turns it on; use_kl_loss chooses a loss
    # term (GRPO/EditGRPO style) over a penalty folded into the reward (PPO style).
    kl_coef: float = 0.0
    use_kl_loss: bool = True
    kl_penalty: str = "low_var_kl"
    # DAPO dynamic sampling: drop groups whose reward std <= filter_min_std and
    # generate more prompts, at most max_filter_rounds extra rounds per step.
    online_filtering: bool = False
    filter_min_std: float = 0.0
    max_filter_rounds: int = 3
    # EasyR1's rule instead, when any of these three is set: keep a group when
    # filter_low < mean over the group of filter_key < filter_high (strict; unset ones take
    # EasyR1's defaults overall, 0.01, 0.99). filter_key: overall (the trained reward), a reward
    # component's key, or a part of an EasyR1 reward's score (accuracy, or <key>/accuracy).
    # filter_min_std then applies too only when > 0 (a group must pass both rules).
    filter_key: str | None = None
    filter_low: float | None = None
    filter_high: float | None = None
    overlong_buffer: OverlongConfig = field(default_factory=OverlongConfig)
    mask_truncated_completions: bool = False
    force_gt_num: int = 0  # EditGRPO: per step, k prompts get one response replaced by their own reference
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    off_policy_sequence_masking: OffPolicySequenceMaskingConfig = field(
        default_factory=OffPolicySequenceMaskingConfig)
    # DeepSeek-V3.2's unbiased KL: the KL loss term per token times exp(log pi_theta - log pi_old)
    unbiased_kl: bool = False
    # On-policy distillation: A = A_rewards + distill_coef * (log pi_teacher - log pi_student_old) per
    # token (grouprl.algorithms.distillation); with no reward configured, pure distillation. None: 1
    # with a teacher (a value without algorithm.teacher.model_path is refused).
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill_coef: float | None = None

    @property
    def distilling(self) -> bool:
        """Whether a teacher is set (``algorithm.teacher.model_path``)."""
        return self.teacher.model_path is not None

    @property
    def mean_filter(self) -> tuple[str, float, float] | None:
        """EasyR1's rule (filter_key, filter_low, filter_high) with its defaults filled in, or None
        when none of the three is set (grouprl's std rule, filter_min_std)."""
        if self.filter_key is None and self.filter_low is None and self.filter_high is None:
            return None
        return (self.filter_key if self.filter_key is not None else "overall",
                self.filter_low if self.filter_low is not None else 0.01,
                self.filter_high if self.filter_high is not None else 0.99)

    @property
    def std_level(self) -> str:
        """adv_std_level, or what norm_adv_by_std_in_grpo says when it is unset."""
        if self.adv_std_level is not None:
            return self.adv_std_level
        return "group" if self.norm_adv_by_std_in_grpo else "none"


@dataclass
class LoraConfig:
    rank: int = 0  # 0 = no LoRA
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    include_vision: bool = False


@dataclass
class ModelConfig:
    model_path: str | None = None
    dtype: str = field(default="float32", metadata=choices("float32", "bfloat16", "float16", "auto"))
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    freeze_vision_tower: bool = False
    trainable_modules: list[str] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    # adamw: fp32 master weights and AdamW state whatever the compute dtype (EasyR1/verl);
    # adamw_bf16: parameters and AdamW state in bf16, half the memory and lossy (small
    # updates round away; at lr 1e-6 most entries of a 0.02-scale weight never change).
    strategy: str = field(default="adamw", metadata=choices("adamw", "adamw_bf16"))
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-2
    lr_warmup_ratio: float = 0.0
    lr_scheduler_type: str = field(default="constant", metadata=choices("constant", "linear", "cosine"))
    min_lr_ratio: float = 0.0


@dataclass
class GSPOConfig:
    """GSPO's (and gspo_token's) own clip range on the sequence ratio; the paper's 3e-4 / 4e-4."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


@dataclass
class CISPOConfig:
    """CISPO's cap on its detached importance weight: [1 - low, 1 + high]; low null = no lower cap."""

    clip_ratio_low: float | None = None
    clip_ratio_high: float = 4.0  # weights capped at 5.0


@dataclass
class SAPOConfig:
    """SAPO's gate temperatures for positive and negative advantages."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass
class EntropyControlConfig:
    """Skywork-OR1's adaptive entropy coefficient (TRL's ``use_adaptive_entropy``; ``grouprl.algorithms.entropy``).

    With ``adaptive``, ``worker.actor.entropy_coeff`` is the starting coefficient; after each
    optimizer step it moves by ``delta`` (up when the step's mean entropy <= ``target``, down
    otherwise) within [``coef_min``, ``coef_max``], and the bonus applies only while the last
    measured entropy <= ``target``.
    """

    adaptive: bool = False
    target: float = 0.2  # nats per token
    coef_min: float = 0.0
    coef_max: float = 1.0
    delta: float = 0.005

    def check(self, key: str) -> None:
        """Raise ConfigError naming the offending key under ``key`` (``worker.actor.entropy_control``)."""
        import math

        for name in ("target", "coef_min", "coef_max", "delta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"config key '{key}.{name}' must be >= 0 and finite; got {value}")
        if self.coef_min > self.coef_max:
            raise ConfigError(f"config key '{key}.coef_min' ({self.coef_min}) is above '{key}.coef_max' "
                              f"({self.coef_max})")


@dataclass
class ActorOffloadConfig:
    """The actor's weights and optimizer state kept in host memory (EasyR1's keys; needs ``strategy: fsdp``).

    Either switch hands every FSDP2 unit torch's ``CPUOffloadPolicy``: the parameter shards, their
    gradients and the AdamW state live on the CPU, the optimizer step runs there, and each unit's
    parameters visit the accelerator only while its forward or backward runs. FSDP2 keeps optimizer
    state beside its parameter shards, so one cannot be offloaded without the other: either key turns
    on both (docs/distributed.md, "CPU offload").
    """

    offload_params: bool = False
    offload_optimizer: bool = False

    @property
    def enabled(self) -> bool:
        return self.offload_params or self.offload_optimizer


@dataclass
class RefOffloadConfig:
    """``offload_params``: the reference model is kept on the CPU and moved to the accelerator for each of
    its forwards (EasyR1's key); it changes where it lives, never what it computes."""

    offload_params: bool = False


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # ddp: every process holds the whole model; fsdp: parameters, gradients and optimizer
    # state sharded over the processes (torch FSDP2), for models DDP cannot hold.
    strategy: str = field(default="ddp", metadata=choices("ddp", "fsdp"))
    global_batch_size: int = 8  # prompts per optimizer step; x rollout.n responses
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward
    micro_batch_size_per_device_for_experience: int = 16  # responses per no-grad log-prob forward
    # Padding-free forwards (EasyR1's key): the old, reference and update forwards run each
    # micro-batch's sequences packed into one row, with positions restarting per sequence, so
    # no pad token is computed (sdpa, eager or flash-attention; M-RoPE positions for Qwen-VL).
    padding_free: bool = False
    # Micro-batches formed by tokens, not rows (EasyR1's key and budget): at most
    # micro_batch_size_per_device_for_* x (the batch's prompt + response width) tokens each,
    # balanced, the same number on every process; the loss and its gradient do not change.
    dynamic_batching: bool = False
    # The output layer runs this many response tokens at a time (with activation checkpointing
    # under gradients), so the [tokens, vocabulary] logits never exist whole; 0: all at once.
    log_prob_chunk_tokens: int = 1024
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    # PPO clip range of the `vanilla` loss (the other losses have their own sections below)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float | None = 3.0
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    # Entropy bonus (EasyR1's key): the loss less entropy_coeff x the policy's token-mean entropy over
    # the loss mask, whatever the loss_agg_mode (TRL's entropy_coef); the adaptive start under entropy_control
    entropy_coeff: float = 0.0
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    offload: ActorOffloadConfig = field(default_factory=ActorOffloadConfig)


@dataclass
class StaticCacheConfig:
    """The ``hf_static`` engine: a static KV cache, a compiled decoder step, shape buckets."""

    compile: bool = True  # false: static cache and buckets, eager decoding
    backend: str = "inductor"  # torch.compile backend
    mode: str | None = None  # torch.compile mode; None: reduce-overhead (CUDA graphs) on a GPU, default elsewhere
    prompt_bucket: int = 64  # prompt widths are padded up to a multiple of this many tokens


# The verifier's default system prompt (Guided-GRPO's teacher, in grouprl's words). It names
# the default stop token; VerifierConfig.check refuses a template that does not name the
# configured one, since the verifier could then never end a dialogue on purpose.
DEFAULT_VERIFIER_TEMPLATE = """\
You are a patient tutor reviewing a student's step-by-step solution. You are given the problem \
(images are shown as [IMAGE]; you cannot see them), the reference answer (N/A when there is none) \
and everything the student has written so far. Write your next message to the student.

1. Errors first. If the student's latest message contains a mistake, point to it, explain why it \
is wrong and how to repair it.
2. Guide as little as possible. If the student is stuck, give one small hint. If the work is \
right, write "Correct." and name the next small goal.
3. Never solve the problem for the student: do not write out several steps of derivation and \
never state the final result.
4. The final answer must be written as <answer>\\boxed{...}</answer>. If it is missing or \
malformed, ask the student to fix the format.
5. As soon as the student has given a correct final answer in that format, reply with ###STOP### \
and nothing else.
6. Be brief: one piece of guidance per message, ending with a short checkpoint question for \
the student.
7. Judge the student's latest message for hallucination: values, facts or steps that the \
problem and the student's earlier work do not support. Unless you are sending ###STOP###, end \
with a line "[SCORE] hallucination_detect=0" if you found hallucination, or \
"[SCORE] hallucination_detect=1" if you found none.
"""


@dataclass
class VerifierConfig:
    """Guided-GRPO's verifier: a teacher model that answers each policy turn of a dialogue.

    After every policy turn (at most ``max_turns``) the verifier sees the problem
    text (images as ``[IMAGE]``), the reference answer and the policy's turns, and
    either guides the next turn or ends the dialogue with ``stop_token``. Backends
    (``backend``; ``auto`` = ``http`` when ``use_http`` else ``local``): ``http``, an
    OpenAI-compatible ``/chat/completions`` server; ``local``, a transformers model
    loaded from ``model_path``; ``rule``, a deterministic stand-in for demos and tests.
    See ``grouprl.rollout.verifier``.
    """

    enable: bool = False
    max_turns: int = 20  # policy turns per dialogue, the first included (the seed's default; its examples set 10)
    # Most tokens per policy turn; None = data.max_response_length. A turn cut off at this limit is
    # still answered by the verifier and the dialogue goes on (as in the seed).
    max_tokens_per_turn: int | None = None
    # Most response tokens per dialogue (policy turns and the text between them); None = no limit
    # but max_turns (the seed has none). A dialogue that reaches it ends with stop reason `length`,
    # its last turn cut at the limit (sampling stops there as if the engine had been told so).
    max_dialogue_tokens: int | None = None
    stop_token: str = "###STOP###"
    # The verifier's system message. The published ruitongl/Guided-Verifier-8B was fine-tuned on the
    # seed's teacher prompt, not on this default (grouprl's wording): serve it with the seed's
    # prompt through prompt_template_file.
    prompt_template: str = DEFAULT_VERIFIER_TEMPLATE
    # A UTF-8 text file whose contents are the system message instead of prompt_template (which must
    # then stay at its default); read when the verifier is built.
    prompt_template_file: str | None = None
    enable_hallucination_score: bool = True  # parse "[SCORE] hallucination_detect=0|1" from replies
    # final_turn: train on the last policy turn only (the seed's original); full_turn: on every policy turn
    train_scope: str = field(default="full_turn", metadata=choices("final_turn", "full_turn"))
    # full_turn's credit: shared (the seed's: every policy turn trains with the dialogue's reward, so a
    # wrong first answer a later turn fixed is reinforced too) or mask_fixed (a dialogue the verifier
    # stopped after a fix trains its final turn only; the turns it did not accept get no loss)
    turn_credit: str = field(default="shared", metadata=choices("shared", "mask_fixed"))
    temperature: float = 0.2
    top_p: float = 0.95
    top_k: int = -1  # -1 = off
    max_tokens: int = 256  # most tokens per verifier reply
    backend: str = "auto"  # auto | http | local | a registered backend (the reasoning domain's rule)
    use_http: bool = False  # the seed's switch; picks http over local when backend is auto
    base_url: str | None = None  # http: e.g. http://host:8000/v1 (requests go to {base_url}/chat/completions)
    model: str | None = None  # http: the served model's name
    # http: the bearer key. None: $GROUPRL_VERIFIER_API_KEY, read when the verifier is built, so the
    # key stays out of the saved config; one written here is saved with it, prefer the variable.
    api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    timeout: float = 300.0  # http: seconds per request
    # http: repeats of a failed request (so max_retries + 1 attempts), after the server's Retry-After,
    # else 0.5 s doubling up to 8 s (the openai SDK's back-off)
    max_retries: int = 3
    # No longer used: the openai SDK sets the back-off. Kept so that a config naming it fails with a
    # clear message instead of an unknown key; set it and check() says what to do.
    retry_backoff: float | None = None
    http_concurrency: int = 4  # http: most requests in flight
    model_path: str | None = None  # local: the verifier checkpoint (a directory or hub id)
    tokenizer_path: str | None = None  # local: None = model_path
    trust_remote_code: bool = False
    # What a verifier call that failed after its retries does. stop: the dialogue ends there as if
    # the verifier had sent the stop token (the seed's behaviour), counted and logged; fail: the
    # step fails with the error.
    on_failure: str = field(default="stop", metadata=choices("stop", "fail"))
    # on_failure stop: after this many failed calls in a row (each after its retries) the verifier is
    # taken as down for the rest of the step: its open dialogues end (stop reason verifier_failure),
    # said once in the log, instead of each one asking a dead server again for every remaining turn.
    max_consecutive_failures: int = 3
    # Sent to the policy instead of ending the dialogue when the verifier stops it before a final answer.
    continue_message: str = "Please continue and provide the final answer in the required format."

    @property
    def resolved_backend(self) -> str:
        """The backend that runs: ``backend``, with ``auto`` read through ``use_http``."""
        if self.backend == "auto":
            return "http" if self.use_http else "local"
        return self.backend

    def check(self, key: str = "worker.rollout.verifier", *, building: bool = False) -> None:
        """Raise ConfigError naming the offending key under ``key``.

        Ranges are checked always; what the chosen backend needs (a URL, a model path)
        only when the verifier is enabled or being built (``building``), so a disabled
        section with half-filled settings does not stop a run that never uses it.
        """
        if self.max_turns < 1:
            raise ConfigError(f"config key '{key}.max_turns' must be >= 1; got {self.max_turns}")
        if self.turn_credit == "mask_fixed" and self.train_scope != "full_turn":
            raise ConfigError(f"config key '{key}.turn_credit' is mask_fixed, which needs '{key}.train_scope: "
                              f"full_turn' ({self.train_scope} trains the last turn only)")
        if not self.stop_token.strip():
            # every reply starts with the empty string: each one would end the dialogue
            raise ConfigError(f"config key '{key}.stop_token' must not be empty or blank")
        if not self.prompt_template.strip():
            raise ConfigError(f"config key '{key}.prompt_template' is empty")
        if self.prompt_template_file is not None:
            if not str(self.prompt_template_file).strip():
                raise ConfigError(f"config key '{key}.prompt_template_file' is empty; leave it out (null) to use "
                                  f"'{key}.prompt_template'")
            if self.prompt_template != DEFAULT_VERIFIER_TEMPLATE:
                raise ConfigError(f"config key '{key}.prompt_template_file' is set and so is '{key}.prompt_template'; "
                                  "set one of them")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ConfigError(f"config key '{key}.max_tokens_per_turn' must be >= 1 or null; "
                              f"got {self.max_tokens_per_turn}")
        if self.max_dialogue_tokens is not None and self.max_dialogue_tokens < 1:
            raise ConfigError(f"config key '{key}.max_dialogue_tokens' must be >= 1 or null; "
                              f"got {self.max_dialogue_tokens}")
        if not self.continue_message.strip():
            raise ConfigError(f"config key '{key}.continue_message' is empty")
        if self.temperature < 0:
            raise ConfigError(f"config key '{key}.temperature' must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"config key '{key}.top_p' must be in (0, 1]; got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"config key '{key}.top_k' must be -1 (off) or >= 0; got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"config key '{key}.max_tokens' must be >= 1; got {self.max_tokens}")
        if not self.timeout > 0:
            raise ConfigError(f"config key '{key}.timeout' must be > 0 seconds; got {self.timeout}")
        if self.max_retries < 0:
            raise ConfigError(f"config key '{key}.max_retries' must be >= 0; got {self.max_retries}")
        if self.retry_backoff is not None:
            raise ConfigError(f"config key '{key}.retry_backoff' is no longer supported: the http verifier's "
                              f"retries wait as the openai client does (the server's Retry-After, else 0.5 s "
                              f"doubling up to 8 s); remove the key, and bound the retries with "
                              f"'{key}.max_retries' and '{key}.timeout'")
        if self.http_concurrency < 1:
            raise ConfigError(f"config key '{key}.http_concurrency' must be >= 1; got {self.http_concurrency}")
        if self.max_consecutive_failures < 1:
            raise ConfigError(f"config key '{key}.max_consecutive_failures' must be >= 1; "
                              f"got {self.max_consecutive_failures}")
        if self.use_http and self.backend not in ("auto", "http"):
            raise ConfigError(f"config key '{key}.use_http' is true but '{key}.backend' is {self.backend!r}; "
                              "set one of them")
        if not (self.enable or building):
            return
        # a template file is checked for the stop token when it is read (grouprl.rollout.verifier)
        if self.prompt_template_file is None and self.stop_token not in self.prompt_template:
            raise ConfigError(f"config key '{key}.prompt_template' never mentions the stop token "
                              f"{self.stop_token!r} ('{key}.stop_token'): the verifier could not end a dialogue")
        backend = self.resolved_backend
        if backend == "http":
            if not self.base_url:
                raise ConfigError(f"config key '{key}.base_url' is required by the http verifier "
                                  "(e.g. http://host:8000/v1)")
            if not self.base_url.startswith(("http://", "https://")):
                raise ConfigError(f"config key '{key}.base_url' must start with http:// or https://; "
                                  f"got {self.base_url!r}")
            if not self.model:
                raise ConfigError(f"config key '{key}.model' is required by the http verifier "
                                  "(the served model's name)")
        elif backend == "local" and not self.model_path:
            raise ConfigError(f"config key '{key}.model_path' is required by the local verifier "
                              f"(or set '{key}.backend: http' with a base_url)")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools and environments (``grouprl.rollout.multiturn``).

    After each policy turn its tool calls run (``tools``, and the environment's tool methods) and
    their results come back as ``tool`` messages; a turn without tool calls goes to the
    environment's ``step`` (an environment with tools alone ends the dialogue there). On when
    ``environment``, ``environments`` or ``tools`` is set. Guided-GRPO's verifier is the
    environment ``verifier``, turned on and set by ``worker.rollout.verifier`` (its own limits).
    """

    # one environment for every record: a registered name (grouprl.rollout.environments.ENVIRONMENTS),
    # path/to/file.py:Class or module:Class (a TRL environment class works as it is)
    environment: str | None = None
    # several, by name: each record's `environment_field` names its environment (TRL's multi-environment runs)
    environments: dict[str, str] = field(default_factory=dict)
    environment_field: str = "environment"
    # tools every dialogue has: registered names, path/to/file.py:function or module:function
    tools: list[str] = field(default_factory=list)
    tool_parser: str | None = None  # hermes | llama3_json | a registered parser; None: from the chat template
    max_turns: int = 4  # policy turns per dialogue, the first included
    max_tokens_per_turn: int | None = None  # None: data.max_response_length
    # most response tokens per dialogue (policy turns and what comes between them); None: no limit but max_turns
    max_dialogue_tokens: int | None = None
    # most tokens between two policy turns (tool results, an environment's reply, the template around
    # them); a dialogue whose next messages are longer ends with stop reason `length`
    max_observation_tokens: int = 512
    max_tool_calls_per_turn: int | None = None  # calls run per policy turn (None: no limit)
    max_tool_calls: int | None = None  # calls run per dialogue (None: no limit)
    tool_timeout: float | None = 30.0  # seconds per tool call; a call past it returns its error to the policy
    step_timeout: float | None = 60.0  # seconds per environment call (reset, step, get_reward)
    # an environment call that fails (raises, times out, returns the wrong type): stop ends its dialogue
    # (stop reason environment_failure, counted in environment/errors), fail fails the step
    on_failure: str = field(default="stop", metadata=choices("stop", "fail"))
    # after this many failed environment calls in a row the environment is taken as down for the call
    max_consecutive_failures: int = 8
    train_scope: str = field(default="full_turn", metadata=choices("final_turn", "full_turn"))
    turn_credit: str = field(default="shared", metadata=choices("shared", "mask_fixed"))
    # weight of each environment reward part (default 1), the parts being reward components
    reward_weights: dict[str, float] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.environment or self.environments or self.tools)

    def check(self, key: str = "worker.rollout.multi_turn") -> None:
        """Raise ConfigError naming the offending key under ``key`` (ranges and shapes; the names are
        resolved when the rollout is built, ``grouprl.rollout.multiturn.dialogue_parts``)."""
        for name in ("max_turns", "max_observation_tokens", "max_consecutive_failures"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{key}.{name}' must be >= 1; got {getattr(self, name)}")
        for name in ("max_tokens_per_turn", "max_dialogue_tokens", "max_tool_calls_per_turn", "max_tool_calls"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"config key '{key}.{name}' must be >= 1 or null; got {value}")
        for name in ("tool_timeout", "step_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"config key '{key}.{name}' must be > 0 seconds or null; got {value}")
        if self.turn_credit == "mask_fixed" and self.train_scope != "full_turn":
            raise ConfigError(f"config key '{key}.turn_credit' is mask_fixed, which needs '{key}.train_scope: "
                              f"full_turn' ({self.train_scope} trains the last turn only)")
        if self.environment and self.environments:
            raise ConfigError(f"config key '{key}.environments' is set and so is '{key}.environment'; set one: "
                              "environment for every record, environments to pick one per record")
        for name, value in self.reward_weights.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"config key '{key}.reward_weights.{name}' must be a finite number; got {value!r}")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"config key '{key}.tools' names a tool more than once")


@dataclass
class RolloutConfig:
    engine: str = "hf"  # a registered rollout engine: hf | hf_static | vllm (grouprl.rollout.engine)
    static_cache: StaticCacheConfig = field(default_factory=StaticCacheConfig)
    # vllm (EasyR1's names): the engine runs in the training process, on the same GPU
    gpu_memory_utilization: float = 0.6  # share of the GPU's memory vLLM may take (weights + KV cache)
    enforce_eager: bool = False  # no CUDA graphs (slower decoding, faster start)
    tensor_parallel_size: int = 1  # vllm: training processes per vLLM engine, its shards (docs/engines.md)
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    enable_sleep_mode: bool = True  # free vLLM's GPU memory during the update
    limit_images: int = 0  # most images per prompt (0: the data's own maximum)
    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    # validation sampling, independent of training's: greedy by default; with val_temperature > 0,
    # val_n responses per prompt give val/.../mean@k, best@k, worst@k, pass@k (trainer.val_metrics)
    val_temperature: float = 0.0
    val_top_p: float = 1.0
    val_n: int = 1
    micro_batch_size: int | None = None  # responses per generate call; None = the whole batch at once
    # EditGRPO post-rollout edits (option names as in the seed)
    extractor: bool = False
    extractor_num_ops_per_para: int = 1
    extractor_num_para: int = -1  # -1: floor(n/2) edited copies per group; k > 0: k responses of the batch
    extractor_similarity_threshold: float = 0.6  # tau
    extractor_type: str = "rules"  # rules | ratescore (RaTE-NER) | radgraph (RadGraph model) | a registered name
    extractor_model_path: str | None = None  # local model directory of the ratescore / radgraph extractors
    extractor_edited_tokens: str = field(default="train", metadata=choices("train", "mask"))
    # Guided-GRPO: a verifier answers each policy turn (multi-turn rollouts)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    # tools and environments between policy turns (agents); the verifier is one environment
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RefConfig:
    model_path: str | None = None  # None: the policy's starting weights (or the policy with LoRA off)
    offload: RefOffloadConfig = field(default_factory=RefOffloadConfig)


@dataclass
class RewardFunctionConfig:
    name: str = ""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    # raise: a reward that raises fails the step, naming it; none: its rows are left unscored (never 0)
    on_error: str = field(default="raise", metadata=choices("raise", "none"))
    # validation's pass@k: a response passes when this reward is at least threshold (1: a 0/1
    # reward's correct answers, or full marks)
    threshold: float = 1.0


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    # EasyR1's single-function form, `path/to/file.py:function`.
    reward_function: str | None = None
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    # How reward_function is called (EasyR1's key): batch, compute_score(list of input dicts) -> list
    # of score dicts; sequential (function: its older name), one dict (or response, ground truth) in,
    # one score dict out. None: EasyR1's file's REWARD_TYPE or the signature decides, and a function
    # f(prompts, completions, **kwargs) is grouprl's contract (grouprl.rewards.easyr1).
    reward_type: str | None = field(default=None, metadata=choices("batch", "sequential", "function"))
    # A reward server's URL (EditGRPO's protocol, `grouprl serve rewards`), scored by the client a
    # plugin registers as "reward_server" (grouprl.rewards.registry.REWARD_SERVER_CLIENTS); its
    # composite is one more weighted component. The keys below are passed on to that client.
    reward_server: str | None = None
    reward_server_weight: float = 1.0
    reward_components: list[str] | None = None  # None: the client's default (radiology: EditGRPO's trainer's)
    type: str = field(default="free_form", metadata=choices("short", "cot", "free_form"))
    server_batch_size: int = 64
    server_max_concurrency: int = 4
    server_timeout: float = 60.0
    server_retries: int = 3
    # Seconds per reward call (each function, the reward server's client included), None = no limit.
    # A call with no result in time is a reward error naming it (its on_error applies), so a hung
    # judge ends the step instead of stalling every process. A plain function then runs in a daemon
    # thread that is abandoned at the limit and may keep running: Python cannot stop it.
    timeout: float | None = None


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class HealthConfig:
    """``trainer.health``: the run's health alarms (grouprl.trainer.health; docs/health.md).

    Windows count training steps; a level or a trend is judged only once its window is full.
    """

    enabled: bool = True  # false: no alarm is judged, no health/ metric logged, no alarms.jsonl
    # held-out metrics (metrics.jsonl keys, e.g. val/report/finding_f1_micro) -> max | min (which
    # way is better): reward_gaming fires when the reward rises while one of them gets worse
    watch: dict[str, str] = field(default_factory=dict)
    reward_key: str = "reward/mean"  # the reward whose rise reward_gaming compares with them
    gaming_window: int = 100  # steps (and the validations within them) the two trends are taken over
    noise_z: float = 2.0  # a trend counts when its change is at least this many standard errors
    window: int = 20  # steps: the span of length_growth; the history a blow-up is measured against
    recent: int = 5  # steps averaged by length_growth (at each end), truncation, no_reward_spread, entropy_collapse
    length_growth: float = 2.0  # mean response length at the window's end / at its start
    max_truncation: float = 0.2  # share of responses cut at data.max_response_length
    entropy_collapse: float = 0.1  # recent entropy / the run's first steps' entropy
    max_zero_std: float = 0.9  # frac_reward_zero_std: share of responses in groups with equal rewards
    ratio_max: float = 2.0  # the mean importance ratio outside [1/ratio_max, ratio_max]
    max_clipfrac: float = 0.5  # share of tokens (flow: rows) the clip acted on
    blowup_factor: float = 10.0  # KL or gradient norm above this many times its recent median
    kl_floor: float = 0.01  # ... and above this (KL grows from 0 at the start)
    grad_norm_floor: float = 0.0  # ... and above this

    def check(self, key: str) -> None:
        """Raise ConfigError naming the offending key under ``key`` (``trainer.health``)."""
        import math

        for name, value in self.watch.items():
            if value not in ("max", "min"):
                raise ConfigError(f"config key '{key}.watch' maps {name!r} to {value!r}; use max (higher is "
                                  "better) or min")
        if not self.reward_key:
            raise ConfigError(f"config key '{key}.reward_key' is empty")
        for name in ("gaming_window", "window", "recent"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{key}.{name}' must be >= 1 step; got {getattr(self, name)}")
        if self.window < 2:
            raise ConfigError(f"config key '{key}.window' must be >= 2 steps (a start and an end); got {self.window}")
        # (low, high): low < value <= high; the shares (max_*) may be 0: any at all then fires
        bounded = {"noise_z": (0, math.inf), "length_growth": (1, math.inf), "max_truncation": (-1, 1),
                   "entropy_collapse": (0, 1), "max_zero_std": (-1, 1), "ratio_max": (1, math.inf),
                   "max_clipfrac": (-1, 1), "blowup_factor": (1, math.inf)}
        for name, (low, high) in bounded.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and low < value <= high and value >= 0):
                bounds = (f"> {low} and finite" if high == math.inf else
                          f"in [0, {high}]" if low < 0 else f"in ({low}, {high}]")
                raise ConfigError(f"config key '{key}.{name}' must be {bounds}; got {value}")
        for name in ("kl_floor", "grad_norm_floor"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"config key '{key}.{name}' must be >= 0 and finite; got {getattr(self, name)}")


@dataclass
class TrainerConfig:
    project_name: str = "grouprl"
    experiment_name: str = "run"
    output_dir: str | None = None  # default: runs/<experiment_name>
    total_epochs: int = 1
    max_steps: int | None = None
    # Stop after the first step that ends this many seconds after the run's steps started (a job's time
    # limit, or two methods given the same time): that step is checkpointed and the run ends as if complete.
    # None = no limit. Each (re)start counts from its own first step.
    max_wall_seconds: float | None = None
    # console, jsonl, tensorboard, wandb, mlflow, trackio (docs/training.md#loggers)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    # Samples tables (prompt, completion, reward components, advantage) and images for the loggers that take
    # them (tensorboard, wandb, mlflow, trackio): training rollouts every this many steps, validation
    # generations at every validation; -1 = none. log_samples_rows caps the rows (and images) of each table.
    log_samples_freq: int = 10
    log_samples_rows: int = 16
    val_freq: int = -1  # -1 = never during training
    val_before_train: bool = False
    val_generations_to_log: int = 4
    # task metrics computed at each validation on the whole validation set against the references,
    # beside the rewards, logged as val/<name>/<key> (grouprl.trainer.task_metrics; e.g. radiology's
    # report, reasoning's exact_match, diffusion's shapes)
    val_metrics: list[str] = field(default_factory=list)
    save_freq: int = -1  # -1 = only at the end
    save_limit: int = -1  # -1 = keep every checkpoint
    save_checkpoint_path: str | None = None  # default: <output_dir>/checkpoints
    resume: str | None = None  # "auto" = the last checkpoint in save_checkpoint_path, or a path
    # A checkpoint is resumed only under the config it was trained with, as far as what trains goes
    # (model, algorithm, rewards, data, rollout sampling, seeds; not logging, paths, max_steps,
    # total_epochs, validation, save cadence, micro-batch sizes: grouprl.trainer.resume_config):
    # otherwise the run stops with one line naming each differing key and both values. Two runs
    # sharing save_checkpoint_path with resume: auto (EasyR1's find_last_checkpoint) are told apart
    # so. true: resume anyway (e.g. a deliberately changed learning rate), naming the differences.
    resume_if_config_changed: bool = False
    log_rollouts: bool = True
    # CheXPO-style completions.jsonl: per-token log-probs (from the sampler) and tokens of every response
    log_completions: bool = False
    seed: int = 1
    device: str = field(default="auto", metadata=choices("auto", "cpu", "cuda"))
    # sync: generate, score, train in turn. async_reward: score each rollout micro-batch
    # (worker.rollout.micro_batch_size rows) while the next one generates. one_step_off:
    # generate and score step k+1's batch (with the weights before step k's update) while
    # step k trains; its old log-probs are recomputed and the staleness is logged.
    async_mode: str = field(default="sync", metadata=choices("sync", "async_reward", "one_step_off"))
    # SIGTERM (Slurm, scancel, Kubernetes) or SIGINT (Ctrl-C) during training: the step in progress
    # finishes, every process saves its checkpoint together, one line names it, and `grouprl train`
    # exits with status 128 + the signal's number (143 for SIGTERM, 130 for SIGINT). A second signal
    # (more than 2 s after the first) exits at once with 128 + its number, without saving; the
    # previous checkpoint stays usable. Under torchrun, raise --shutdown_timeout (default 30 s) if a
    # step and a save take longer: the agent kills its workers that long after forwarding the signal.
    # false: SIGTERM ends the process at once, SIGINT stops it with one line (status 130), no save.
    save_on_signal: bool = True
    # A step in which no row on any process got a score (no reward applied to any) trains on
    # nothing. Such steps are counted (reward/unscored_steps) and the first is warned about; with
    # this the run stops there instead (a reward that never applies would otherwise train silently).
    fail_on_unscored_steps: bool = False
    # Seconds a collective (gradient all-reduce, metric reduction, checkpoint gather) waits for the
    # other processes before the job fails, naming this process and its stage (grouprl.trainer.parallel).
    # Torch's defaults are 30 min (gloo) and 10 min (NCCL); 600 s ends a frozen process's job in about
    # ten minutes on either, and is still far above any step's wait on a slower process. Raise it
    # when processes legitimately wait longer for each other (a long validation or save on one process).
    distributed_timeout: float = 600.0
    # The best checkpoint: after each validation whose value of this metrics.jsonl key (a validation
    # metric, e.g. val/reward/mean@4 or val/report/finding_f1_micro) beats the best so far (strictly;
    # NaN never does), that step's checkpoint is kept as <checkpoint dir>/best, never pruned by
    # save_limit and never resumed by resume: auto; run_info.json names it ("best"). None: no best kept.
    best_metric: str | None = None
    # max: higher is better; min: lower. null means max (set only with best_metric).
    best_mode: str | None = field(default=None, metadata=choices("max", "min"))
    # Validate, then stop without training (EasyR1's key): `grouprl train` runs what `grouprl validate`
    # runs, on the checkpoint trainer.resume names (auto: the newest), else on the model.
    val_only: bool = False
    # health alarms: reward gaming, length growth, truncation, entropy collapse, no reward spread,
    # ratio / KL / gradient norm blow-ups, NaN (docs/health.md)
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class SFTConfig:
    """`grouprl sft`: supervised warm start on the datasets' reference answers."""

    epochs: int = 1
    batch_size: int = 16  # samples per optimizer step
    micro_batch_size: int = 8
    lr: float | None = None  # None: worker.actor.optim.lr


class RunPaths:
    """Where a run writes, read from its ``trainer`` section (the language and the flow trainer's configs)."""

    trainer: TrainerConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir or Path("runs") / self.trainer.experiment_name)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.trainer.save_checkpoint_path or self.run_dir / "checkpoints")


@dataclass
class Config(RunPaths):
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
