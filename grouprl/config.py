"""Typed run configuration in the EasyR1/verl shape, read from YAML with dotted overrides.

    grouprl train config.yaml worker.rollout.n=5 algorithm.loss_agg_mode=seq-mean-token-sum-norm

The tree is a set of dataclasses; every key a user can write is a field here, so
an unknown key is caught with the closest valid keys, and every value is checked
against the field's type (and its ``choices`` where it has a closed set).
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import os
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def _choices(*values: str) -> dict:
    return {"choices": values}


# ---------------------------------------------------------------------------- schema


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    format: str = field(default="auto", metadata=_choices("auto", "easyr1", "llava", "swift"))
    prompt_key: str | None = None
    answer_key: str | None = None
    image_key: str | None = None
    image_dir: str | None = None
    id_key: str = "id"  # the record field that identifies a sample in logs and outputs
    system_prompt: str | None = None
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
    level: str = field(default="sequence", metadata=_choices("token", "sequence"))
    mode: str = field(default="mask", metadata=_choices("truncate", "mask"))
    clip_max: float | None = 3.0
    clip_min: float | None = None


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    policy_loss: str = "vanilla"
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
    overlong_buffer: OverlongConfig = field(default_factory=OverlongConfig)
    mask_truncated_completions: bool = False
    force_gt_num: int = 0  # EditGRPO: per step, k prompts get one response replaced by their own reference
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


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
    dtype: str = field(default="float32", metadata=_choices("float32", "bfloat16", "float16", "auto"))
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
    strategy: str = field(default="adamw", metadata=_choices("adamw", "adamw_bf16"))
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-2
    lr_warmup_ratio: float = 0.0
    lr_scheduler_type: str = field(default="constant", metadata=_choices("constant", "linear", "cosine"))
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
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # ddp: every process holds the whole model; fsdp: parameters, gradients and optimizer
    # state sharded over the processes (torch FSDP2), for models DDP cannot hold.
    strategy: str = field(default="ddp", metadata=_choices("ddp", "fsdp"))
    global_batch_size: int = 8  # prompts per optimizer step; x rollout.n responses
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward
    micro_batch_size_per_device_for_experience: int = 16  # responses per no-grad log-prob forward
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    # PPO clip range of the `vanilla` loss (the other losses have their own sections below)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float | None = 3.0
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)


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
    max_turns: int = 10  # policy turns per dialogue, the first included
    stop_token: str = "###STOP###"
    prompt_template: str = DEFAULT_VERIFIER_TEMPLATE  # the verifier's system message
    enable_hallucination_score: bool = True  # parse "[SCORE] hallucination_detect=0|1" from replies
    # final_turn: train on the last policy turn only (the seed's original); full_turn: on every policy turn
    train_scope: str = field(default="full_turn", metadata=_choices("final_turn", "full_turn"))
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
    on_failure: str = field(default="stop", metadata=_choices("stop", "fail"))
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
        if not self.stop_token.strip():
            # every reply starts with the empty string: each one would end the dialogue
            raise ConfigError(f"config key '{key}.stop_token' must not be empty or blank")
        if not self.prompt_template.strip():
            raise ConfigError(f"config key '{key}.prompt_template' is empty")
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
        if self.use_http and self.backend not in ("auto", "http"):
            raise ConfigError(f"config key '{key}.use_http' is true but '{key}.backend' is {self.backend!r}; "
                              "set one of them")
        if not (self.enable or building):
            return
        if self.stop_token not in self.prompt_template:
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
class RolloutConfig:
    engine: str = "hf"  # a registered rollout engine: hf | hf_static | vllm (grouprl.rollout.engine)
    static_cache: StaticCacheConfig = field(default_factory=StaticCacheConfig)
    # vllm (EasyR1's names): the engine runs in the training process, on the same GPU
    gpu_memory_utilization: float = 0.6  # share of the GPU's memory vLLM may take (weights + KV cache)
    enforce_eager: bool = False  # no CUDA graphs (slower decoding, faster start)
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    enable_sleep_mode: bool = True  # free vLLM's GPU memory during the update
    limit_images: int = 0  # most images per prompt (0: the data's own maximum)
    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    val_temperature: float = 0.0  # greedy validation
    val_n: int = 1
    micro_batch_size: int | None = None  # responses per generate call; None = the whole batch at once
    # EditGRPO post-rollout edits (option names as in the seed)
    extractor: bool = False
    extractor_num_ops_per_para: int = 1
    extractor_num_para: int = -1  # -1: floor(n/2) edited copies per group; k > 0: k responses of the batch
    extractor_similarity_threshold: float = 0.6  # tau
    extractor_type: str = "rules"  # rules | ratescore (RaTE-NER) | radgraph (RadGraph model) | a registered name
    extractor_model_path: str | None = None  # local model directory of the ratescore / radgraph extractors
    extractor_edited_tokens: str = field(default="train", metadata=_choices("train", "mask"))
    # Guided-GRPO: a verifier answers each policy turn (multi-turn rollouts)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)


@dataclass
class RefConfig:
    model_path: str | None = None  # None: the policy's starting weights (or the policy with LoRA off)


@dataclass
class RewardFunctionConfig:
    name: str = ""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    # EasyR1's single-function form, `path/to/file.py:function`.
    reward_function: str | None = None
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    # A reward server's URL (EditGRPO's protocol, `grouprl serve rewards`), scored by the client a
    # plugin registers as "reward_server" (grouprl.rewards.registry.REWARD_SERVER_CLIENTS); its
    # composite is one more weighted component. The keys below are passed on to that client.
    reward_server: str | None = None
    reward_server_weight: float = 1.0
    reward_components: list[str] | None = None  # None: the client's default (radiology: EditGRPO's trainer's)
    type: str = field(default="free_form", metadata=_choices("short", "cot", "free_form"))
    server_batch_size: int = 64
    server_max_concurrency: int = 4
    server_timeout: float = 60.0
    server_retries: int = 3


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class TrainerConfig:
    project_name: str = "grouprl"
    experiment_name: str = "run"
    output_dir: str | None = None  # default: runs/<experiment_name>
    total_epochs: int = 1
    max_steps: int | None = None
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    val_freq: int = -1  # -1 = never during training
    val_before_train: bool = False
    val_generations_to_log: int = 4
    save_freq: int = -1  # -1 = only at the end
    save_limit: int = -1  # -1 = keep every checkpoint
    save_checkpoint_path: str | None = None  # default: <output_dir>/checkpoints
    resume: str | None = None  # "auto" = the last checkpoint in save_checkpoint_path, or a path
    log_rollouts: bool = True
    # CheXPO-style completions.jsonl: per-token log-probs (from the sampler) and tokens of every response
    log_completions: bool = False
    seed: int = 1
    device: str = field(default="auto", metadata=_choices("auto", "cpu", "cuda"))
    # sync: generate, score, train in turn. async_reward: score each rollout micro-batch
    # (worker.rollout.micro_batch_size rows) while the next one generates. one_step_off:
    # generate and score step k+1's batch (with the weights before step k's update) while
    # step k trains; its old log-probs are recomputed and the staleness is logged.
    async_mode: str = field(default="sync", metadata=_choices("sync", "async_reward", "one_step_off"))


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


# ---------------------------------------------------------------------------- building


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], key + "."))
    return keys


# The schema whose keys an unknown key is compared with: the language trainer's Config, or
# another root (the flow trainer's) while `build_config` builds one.
_SCHEMA_ROOT: contextvars.ContextVar[type] = contextvars.ContextVar("grouprl_config_schema_root")


def _unknown_key(key: str) -> ConfigError:
    valid = all_keys(_SCHEMA_ROOT.get(Config))
    leaf = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    # A right leaf name under the wrong section is the common mistake: suggest by leaf too.
    near += [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k not in near][:3]
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, choices: tuple | None = None) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, choices)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"config key '{key}': {value!r} is not a valid {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str) and item_tp is str:
            # `data.train_files=a.jsonl,b.jsonl` on the command line
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads 1e-6 as a string (no dot); accept what float() accepts
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"config key '{key}' expects a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
        value = str(value)
        if choices and value not in choices:
            raise ConfigError(f"config key '{key}' accepts one of {', '.join(choices)}; got {value!r}")
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")  # a schema bug, not a user error


def _build(cls: type, values: dict, prefix: str = ""):
    hints = get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise _unknown_key(f"{prefix}{key}")
        f = names[key]
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}", f.metadata.get("choices"))
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML (``true``, ``3``, ``[a, b]``)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else None
        _set_dotted(tree, key, value)
    return tree


def merge_values(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``, nested sections merged key by key (neither is changed)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def build_config(root: type, values: dict):
    """``values`` checked against the dataclass schema ``root`` (types, choices, unknown keys with suggestions)."""
    token = _SCHEMA_ROOT.set(root)
    try:
        return _build(root, values or {})
    finally:
        _SCHEMA_ROOT.reset(token)


def read_config_values(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                       base: dict | None = None) -> dict:
    """The YAML file (optional) over ``base`` with dotted overrides applied, as a plain dict."""
    values: dict = dict(base or {})
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        values = merge_values(values, loaded)
    return merge_values(values, parse_overrides(overrides or []))


def config_from_dict(values: dict) -> Config:
    config = _build(Config, values or {})
    validate(config)
    return config


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Read a YAML file (optional) over ``base`` and apply dotted overrides, then validate."""
    return config_from_dict(read_config_values(path, overrides, base))


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def redacted(config: Config) -> dict:
    """The config as a dict for files and loggers: every field marked secret (API keys) is None."""
    return _without_secrets(to_dict(config), type(config))


def _without_secrets(values: dict, cls: type = Config) -> dict:
    """``values`` (``to_dict`` of a ``cls``) with every field marked secret set to None."""
    hints = get_type_hints(cls)
    out = dict(values)
    for f in dataclasses.fields(cls):
        if f.metadata.get("secret"):
            out[f.name] = None
        elif dataclasses.is_dataclass(hints[f.name]) and isinstance(out.get(f.name), dict):
            out[f.name] = _without_secrets(out[f.name], hints[f.name])
    return out


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically, with secrets (API keys) left out."""
    write_text_atomic(Path(path), yaml.safe_dump(redacted(config), sort_keys=False))


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- cross-field checks


def _check_name(key: str, value: str, registry) -> None:
    """``value`` is a name in ``registry`` (a :class:`grouprl.registry.Registry`, plugins' names included)."""
    known = registry.names()
    if value not in known:
        raise ConfigError(f"config key '{key}' accepts one of {', '.join(known)}; got {value!r}")


def _positive(key: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"config key '{key}' must be {'>= 0' if allow_zero else '> 0'}; got {value}")


def validate(config: Config) -> None:
    """Checks that need more than one field or a registry."""
    from grouprl import algorithms  # registries are pluggable, so read them at validation time
    from grouprl.rollout.engine import ROLLOUT_ENGINES
    from grouprl.rollout.verifier import VERIFIER_BACKENDS

    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    _check_name("algorithm.adv_estimator", algo.adv_estimator, algorithms.ADVANTAGE_ESTIMATORS)
    _check_name("algorithm.policy_loss", algo.policy_loss, algorithms.POLICY_LOSSES)
    _check_name("algorithm.loss_agg_mode", algo.loss_agg_mode, algorithms.LOSS_AGG_MODES)
    _check_name("algorithm.kl_penalty", algo.kl_penalty, algorithms.KL_ESTIMATORS)
    _check_name("worker.rollout.engine", rollout.engine, ROLLOUT_ENGINES)
    _positive("algorithm.kl_coef", algo.kl_coef, allow_zero=True)
    _positive("worker.rollout.n", rollout.n)
    if rollout.temperature <= 0:
        # the loss scores sampled tokens at the sampling temperature; greedy rollouts have none
        # (and give every response of a group the same text, so no group-relative signal)
        raise ConfigError(f"config key 'worker.rollout.temperature' must be > 0 for training rollouts; "
                          f"got {rollout.temperature} (greedy decoding is for validation: worker.rollout.val_temperature)")
    _positive("worker.rollout.val_temperature", rollout.val_temperature, allow_zero=True)
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"config key 'worker.rollout.top_p' must be in (0, 1]; got {rollout.top_p}")
    rollout.verifier.check("worker.rollout.verifier")
    if rollout.verifier.backend != "auto":  # auto: http or local, by use_http
        _check_name("worker.rollout.verifier.backend", rollout.verifier.backend, VERIFIER_BACKENDS)
    _positive("data.rollout_batch_size", config.data.rollout_batch_size)
    _positive("data.max_response_length", config.data.max_response_length)
    _positive("worker.actor.global_batch_size", actor.global_batch_size)
    _positive("worker.actor.micro_batch_size_per_device_for_update", actor.micro_batch_size_per_device_for_update)
    _positive("worker.actor.micro_batch_size_per_device_for_experience", actor.micro_batch_size_per_device_for_experience)
    _positive("worker.actor.ppo_epochs", actor.ppo_epochs)
    _positive("worker.actor.optim.lr", actor.optim.lr, allow_zero=True)
    if config.data.rollout_batch_size % actor.global_batch_size:
        raise ConfigError(
            f"config key 'data.rollout_batch_size' ({config.data.rollout_batch_size}) must be a multiple of "
            f"'worker.actor.global_batch_size' ({actor.global_batch_size})"
        )
    model = actor.model
    if model.dtype == "float16":
        raise ConfigError("config key 'worker.actor.model.dtype': float16 training needs loss scaling, which "
                          "grouprl does not do; use bfloat16 (bf16 compute over fp32 master weights)")
    if actor.optim.strategy == "adamw_bf16" and model.dtype != "bfloat16":
        raise ConfigError("config key 'worker.actor.optim.strategy': adamw_bf16 keeps parameters and optimizer "
                          f"state in bf16 and needs 'worker.actor.model.dtype: bfloat16'; got {model.dtype!r}")
    if config.trainer.async_mode == "one_step_off" and algo.online_filtering:
        raise ConfigError("config key 'trainer.async_mode': one_step_off with 'algorithm.online_filtering' is not "
                          "supported yet (dynamic sampling agrees across processes while the next batch generates)")
    if actor.strategy == "fsdp" and model.lora.rank > 0:
        raise ConfigError("config key 'worker.actor.strategy': fsdp with LoRA ('worker.actor.model.lora.rank' > 0) "
                          "is not supported yet; LoRA adapters are small enough for ddp")
    if len(actor.optim.betas) != 2:
        raise ConfigError(f"config key 'worker.actor.optim.betas' needs two numbers; got {actor.optim.betas}")
    if config.worker.reward.functions and config.worker.reward.reward_function:
        raise ConfigError("set either 'worker.reward.functions' or 'worker.reward.reward_function', not both")
    for i, fn in enumerate(config.worker.reward.functions):
        if not fn.name:
            raise ConfigError(f"config key 'worker.reward.functions[{i}].name' is empty")
    if config.trainer.resume not in (None, "auto") and not Path(config.trainer.resume).exists():
        raise ConfigError(f"config key 'trainer.resume': no checkpoint at {config.trainer.resume}")
    allowed_loggers = {"console", "jsonl", "tensorboard", "wandb"}
    for name in config.trainer.logger:
        if name not in allowed_loggers:
            raise ConfigError(f"config key 'trainer.logger' accepts {', '.join(sorted(allowed_loggers))}; got {name!r}")
