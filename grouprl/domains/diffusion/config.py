"""The flow trainer's configuration: the language trainer's shape (data, algorithm, worker, trainer).

A YAML file with ``kind: flow`` at the top level is read with this schema by
``grouprl train``. The sections and names follow the language side where the idea is
the same (``worker.actor.optim``, ``worker.actor.model.lora``, ``worker.rollout.n``,
``worker.reward.functions``, the whole ``trainer`` section) and MM-GRPO / Flow-GRPO's
names where it is new (``noise_level``, ``timestep_fraction``, ``clip_range``,
``sde_window_size``, ``sde_window_range``, ``guidance_scale``).

Algorithms (``algorithm.name``):

- ``flow_grpo``: every step of the rollout but the last (``deterministic_last_step``) is an
  SDE step; the first ``timestep_fraction`` of them are trained (Flow-GRPO).
- ``flow_grpo_fast``: ODE steps except a random window of ``sde_window_size`` SDE
  steps per rollout batch; only the window is stored and trained (Flow-GRPO-Fast).
- ``grpo_guard``: Flow-GRPO with GRPO-Guard's ratio normalisation (RatioNorm with the
  rollout's stored means) and the 1/|dt| gradient reweighting.
- ``diffusion_nft``: DiffusionNFT (NVlabs): no likelihoods; the clean samples of any sampler
  (the ODE with ``noise_level: 0``) are noised again at ``int(num_steps * timestep_fraction)``
  of the schedule's times each and the velocity is trained between the implicit positive and
  negative policies around a second, "old" adapter that samples (``algorithm.nft``;
  ``domains.diffusion.nft``). ``clip_range`` is unused.

Numbers that read differently from the peers' (flow_grpo, MM-GRPO, verl-omni) on the same run:

- ``actor/clipfrac`` is the peers' clip fraction, the share of rows with |r - 1| > clip_range
  whatever the sign of the advantage; ``actor/clipped_grad_frac`` is the share whose gradient
  the clip zeroes (A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps), at most the former.
- CPS (``worker.rollout.kind: cps``): grouprl's log-probability is the step's true Gaussian
  log-density, mean_CHW[-(x' - mu)^2 / (2 std^2)] - log std - log(2 pi) / 2 with
  std = sigma_next sin(a pi / 2); the peers' CPS code uses -mean_CHW (x' - mu)^2. The
  constants cancel in a ratio, the factor does not: log r (grouprl) = log r (peer) / (2 std^2),
  so a peer's CPS clip range eps_peer corresponds here to eps_peer / (2 std^2) at each step,
  wider wherever std < 0.71 (all but the first steps): at a = 0.8 (sin = 0.95) about
  2.2 eps_peer at sigma_next = 0.5 and 55 eps_peer at sigma_next = 0.1. No single number converts a
  recipe's range; tune it on the logged ``actor/ratio/std`` and ``actor/clipfrac``. The SDE
  kind (``sde``) uses the full Gaussian density in both, so its ranges carry over.
- Advantages use the sample std (divisor m - 1, as grouprl's ``grpo`` estimator); flow_grpo's
  numpy code uses the population std (divisor m), m = the rewards the std is over (the whole
  batch with ``global_std``, a group otherwise). A(grouprl) = A(flow_grpo) sqrt((m - 1) / m):
  3% smaller for a group of 16 without ``global_std``, negligible over a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grouprl.config import (
    ConfigError,
    LoraConfig,
    OptimConfig,
    RewardFunctionConfig,
    RunPaths,
    TrainerConfig,
    build_config,
    choices,
    config_sources,
    read_config_values,
)
from grouprl.trainer.task_metrics import check_task_metric_names

FLOW_ALGORITHMS = ("flow_grpo", "flow_grpo_fast", "grpo_guard", "diffusion_nft")

# algorithm.kl_coef when the config leaves it unset, per algorithm: flow_grpo's beta 0.04 (its SD3.5 OCR and
# GenEval configs, as the notes give them) for the Flow-GRPO family; for DiffusionNFT 1e-4, NVlabs' DiffusionNFT
# config (train.beta, the value examples/diffusion_nft_sd35m_ocr.yaml carries from their config/nft.py; not
# re-checked against their repository here): their KL is a velocity difference, on another scale than Flow-GRPO's
DEFAULT_KL_COEF = {"flow_grpo": 0.04, "flow_grpo_fast": 0.04, "grpo_guard": 0.04, "diffusion_nft": 1e-4}


@dataclass
class FlowDataConfig:
    # JSON lines, one prompt per record: {"prompt": "...", <metadata columns passed to the rewards>}
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    rollout_batch_size: int = 4  # prompts per training step (each sampled worker.rollout.n times)
    val_batch_size: int = 16  # prompts per validation sampler call
    max_samples: int | None = None
    val_max_samples: int | None = None
    shuffle: bool = True
    seed: int = 1


@dataclass
class FlowNFTConfig:
    """DiffusionNFT's settings (``algorithm.name: diffusion_nft``), named and defaulted as NVlabs' config/nft.py.

    The loss ``r ||v+ - v||^2 + (1 - r) ||v- - v||^2`` with ``v+ = (1 - beta) v_old + beta v_theta`` and
    ``v- = (1 + beta) v_old - beta v_theta`` (``nft.nft_loss``), r = clip(A, +-adv_clip_max) / (2
    adv_clip_max) + 1/2. After every training step the old adapter becomes ``d old + (1 - d) theta`` with
    ``d = min(max(optimizer steps - decay_flat, 0) decay_rate, decay_ceiling)`` (``nft.old_policy_decay``):
    NVlabs' decay_type 1 is flat 0, rate 0.001, ceiling 0.5 (the default here); their OCR recipe's
    decay_type 2 is flat 75, rate 0.0075, ceiling 0.999, with beta 0.1. ``algorithm.kl_coef`` weighs their
    KL, mean((v_theta - v_ref)^2) to the velocity with the adapters off (their train.beta, 1e-4: the value
    an unset kl_coef takes under diffusion_nft, ``DEFAULT_KL_COEF``).
    """

    beta: float = 1.0  # the step of the implicit policies (NVlabs' config.beta: 1.0; 0.1 for OCR)
    adaptive_weighting: bool = True  # each term divided by its own detached mean |x0 error| (their released code)
    decay_flat: int = 0
    decay_rate: float = 0.001
    decay_ceiling: float = 0.5


@dataclass
class FlowAlgorithmConfig:
    name: str = field(default="flow_grpo", metadata=choices(*FLOW_ALGORITHMS))
    # A = (R - mean of the group) / (std + 1e-4): std over the whole batch (Flow-GRPO's default) or per group;
    # the sample std (m - 1): flow_grpo's population std gives advantages larger by sqrt(m / (m - 1))
    global_std: bool = True
    adv_clip_max: float = 5.0
    # beta of the KL to the reference (the policy with LoRA off); 0 = no reference pass; None (unset): the
    # algorithm's own value, resolved when the config is built (DEFAULT_KL_COEF, default_kl_coef)
    kl_coef: float | None = None
    # PPO clip range of the per-step ratio. log p averages over every latent element, so
    # ratios stay very near 1 and the range must be tiny: Flow-GRPO 1e-4, Fast 1e-5, Guard
    # 2e-6 at SD3.5-M's 65k elements; a small model needs a larger one. With kind cps a peer's
    # range is not this one: log r here = the peer's log r / (2 std^2) (the module docstring).
    clip_range: float = 1e-4
    timestep_fraction: float = 0.99  # flow_grpo / grpo_guard: train the first 99% of the steps (0..8 of 10)
    #                                  diffusion_nft: int(N f) of the N schedule times per image, drawn at random
    nft: FlowNFTConfig = field(default_factory=FlowNFTConfig)


@dataclass
class FlowModelConfig:
    model_path: str | None = None  # a local diffusers directory (StableDiffusion3Pipeline, or grouprl's tiny pixel model)
    dtype: str = field(default="float32", metadata=choices("float32", "bfloat16"))
    # prompt length in text-encoder tokens (T5 / UMT5 / Qwen2.5-VL); null: the model family's pipeline
    # default (SD3 256; FLUX.1, Qwen-Image, Wan 512)
    max_sequence_length: int | None = None
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(rank=32, alpha=64, target_modules=["attention"]))


@dataclass
class FlowEMAConfig:
    """An exponential moving average of the trained weights (the LoRA adapters), as flow_grpo keeps in its
    SD3 recipes: validation samples with it, and each checkpoint holds it beside the raw weights
    (``model/ema.safetensors``), from which a resumed run continues it exactly.

    After optimizer step s (counted from 1 over the run; a training step takes ``num_minibatches x
    ppo_epochs`` of them): before or at ``start_step`` the average follows the weights (ema = param);
    after it, every ``update_interval``-th optimizer step, ema = d ema + (1 - d) param with d = ``decay``,
    or with ``warmup`` d = min(decay, (1 + n) / (10 + n)), n = s - start_step (diffusers' EMAModel and
    flow_grpo cap the decay so in the first steps).
    The peers count optimizer steps too: NVlabs' DiffusionNFT (their EMA with the warm-up cap, after each
    optimizer step) and flow_grpo's SD3 script (scripts/train_sd3.py with flow_grpo/ema.py: decay 0.9,
    update_step_interval 8, the warmup cap with n = the optimizer steps so far). flow_grpo calls the update
    once per training sub-batch (after that sub-batch's timesteps) with the optimizer-step count, and the
    update runs whenever (count + 1) is a multiple of 8: every 8th optimizer step the average is updated as
    many times in a row as an optimizer step has sub-batches (8 on their SD3 configs by an outside count;
    not re-checked here), then not until the next. ``update_interval: 8`` updates it once every 8th
    optimizer step instead.
    """

    enabled: bool = False
    decay: float = 0.9
    start_step: int = 0  # optimizer steps before the average starts to lag behind the weights
    update_interval: int = 1  # update every this many optimizer steps after start_step
    warmup: bool = False  # cap the decay at (1 + n) / (10 + n), n optimizer steps after start_step


@dataclass
class FlowActorConfig:
    model: FlowModelConfig = field(default_factory=FlowModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, weight_decay=1e-4))
    micro_batch_size: int = 8  # (sample, step) rows per forward/backward
    num_minibatches: int = 1  # optimizer steps per pass over a training step's rows
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    ema: FlowEMAConfig = field(default_factory=FlowEMAConfig)


@dataclass
class FlowRolloutConfig:
    n: int = 8  # images per prompt (the group)
    num_steps: int = 10  # denoising steps of a training rollout
    guidance_scale: float = 4.5  # classifier-free guidance, in rollout and in the log-prob; 1 = none
    noise_level: float = 0.7  # a of the SDE; 0 = the ODE
    kind: str = field(default="sde", metadata=choices("sde", "cps"))
    height: int = 512
    width: int = 512
    # frames per sample of a text-to-video model (Wan); null for an image model (the two are refused crossed)
    num_frames: int | None = None
    sde_window_size: int = 2  # flow_grpo_fast
    sde_window_range: list[int] = field(default_factory=lambda: [0, 10])  # flow_grpo_fast: where the window may start/end
    # The last denoising step (into sigma = 0) an ODE step, never sampled with noise nor trained, as
    # MM-GRPO and the later flow_grpo do (their SDE window ends at num_steps - 1): flow_grpo and
    # grpo_guard make steps 0 .. N-2 SDE steps (and train the first timestep_fraction of those), the
    # Fast window lies inside [r0, min(r1, N - 1)). false: every step may be an SDE step and trained
    # (grouprl before; the original Flow-GRPO sampled the last step with noise but did not train it).
    deterministic_last_step: bool = True
    micro_batch_size: int = 8  # images per sampler call
    val_num_steps: int = 40  # validation: ODE (no noise) with more steps
    val_guidance_scale: float | None = None  # None: guidance_scale
    val_seed: int = 0  # validation noise: the same images every time for the same weights
    # images per validation prompt, each from its own noise: val/.../mean@k, best@k, worst@k, pass@k
    # (a reward's pass threshold: worker.reward.functions[i].threshold)
    val_n: int = 1
    val_images_to_log: int = 16  # images in the validation grid PNG


@dataclass
class FlowRewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    # MM-GRPO's data.val_reward_fn: scored at validation instead of `functions` when set
    val_functions: list[RewardFunctionConfig] = field(default_factory=list)
    # seconds per image reward call, None = no limit (as the language trainer's worker.reward.timeout)
    timeout: float | None = None
    # a text-to-video model: frames of each video the image rewards score (k evenly spaced, first and last
    # among them), their values averaged per video (domains.diffusion.video); null = every frame
    video_frames: int | None = None


@dataclass
class FlowWorkerConfig:
    actor: FlowActorConfig = field(default_factory=FlowActorConfig)
    rollout: FlowRolloutConfig = field(default_factory=FlowRolloutConfig)
    reward: FlowRewardConfig = field(default_factory=FlowRewardConfig)


@dataclass
class FlowConfig(RunPaths):
    kind: str = field(default="flow", metadata=choices("flow"))
    data: FlowDataConfig = field(default_factory=FlowDataConfig)
    algorithm: FlowAlgorithmConfig = field(default_factory=FlowAlgorithmConfig)
    worker: FlowWorkerConfig = field(default_factory=FlowWorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def require_diffusers() -> None:
    """Fail with the extra to install when diffusers is missing (the sampling math itself needs only torch)."""
    from grouprl.errors import FEATURE_EXTRAS

    FEATURE_EXTRAS["kind: flow"].require()


def sde_range(rollout: FlowRolloutConfig) -> tuple[int, int]:
    """Flow-GRPO-Fast's window range [r0, r1), its end moved to num_steps - 1 with ``deterministic_last_step``."""
    start, end = rollout.sde_window_range
    return start, min(end, rollout.num_steps - 1) if rollout.deterministic_last_step else end


def trained_steps(num_steps: int, timestep_fraction: float, deterministic_last_step: bool) -> list[int]:
    """Flow-GRPO's trained steps: the first int(N f) of the N steps, less the last with ``deterministic_last_step``
    (an ODE step has no log-probability). Empty when none is left."""
    count = int(num_steps * timestep_fraction)
    end = num_steps - 1 if deterministic_last_step else num_steps
    return list(range(min(count, end)))


def nft_timesteps(num_steps: int, timestep_fraction: float) -> int:
    """DiffusionNFT's training times per image: int(N f) of the N schedule times (NVlabs' num_train_timesteps)."""
    return int(num_steps * timestep_fraction)


def validate_nft(config: FlowConfig) -> None:
    nft, rollout = config.algorithm.nft, config.worker.rollout
    _positive("algorithm.nft.beta", nft.beta)
    _positive("algorithm.nft.decay_flat", nft.decay_flat, allow_zero=True)
    _positive("algorithm.nft.decay_rate", nft.decay_rate, allow_zero=True)
    if not 0 <= nft.decay_ceiling <= 1:
        raise ConfigError(f"config key 'algorithm.nft.decay_ceiling' must be in [0, 1]; got {nft.decay_ceiling}")
    if not nft_timesteps(rollout.num_steps, config.algorithm.timestep_fraction):
        raise ConfigError(f"config keys 'algorithm.timestep_fraction' ({config.algorithm.timestep_fraction}) and "
                          f"'worker.rollout.num_steps' ({rollout.num_steps}) leave no time to train at")
    if config.trainer.async_mode == "one_step_off":
        raise ConfigError("config key 'trainer.async_mode' is one_step_off, which diffusion_nft does not support: its "
                          "old adapter samples, and is updated after each step; use sync or async_reward")


def is_flow_config(values: dict) -> bool:
    """Whether a config file's values are a flow trainer's (``kind: flow`` at the top level)."""
    return isinstance(values, dict) and values.get("kind") == "flow"


def default_kl_coef(algorithm: str) -> float:
    """``algorithm.kl_coef`` for a config that leaves it unset: ``DEFAULT_KL_COEF[algorithm]`` (0.04 for
    flow_grpo, flow_grpo_fast and grpo_guard, 1e-4 for diffusion_nft)."""
    return DEFAULT_KL_COEF[algorithm]


def resolve_flow_defaults(config: FlowConfig) -> FlowConfig:
    """Fill the keys whose default depends on another key, in place: an unset ``algorithm.kl_coef`` becomes
    ``default_kl_coef(algorithm.name)``; a value the config sets is kept. The trainer and the run directory's
    config.yaml then see the number the run uses."""
    if config.algorithm.kl_coef is None:
        config.algorithm.kl_coef = default_kl_coef(config.algorithm.name)
    return config


def flow_config_from_dict(values: dict) -> FlowConfig:
    config = resolve_flow_defaults(build_config(FlowConfig, values))
    validate_flow(config)
    return config


def load_flow_config(path=None, overrides: list[str] | None = None, base: dict | None = None) -> FlowConfig:
    values = read_config_values(path, overrides, {"kind": "flow", **(base or {})})
    with config_sources(values):  # an error naming a key says where it was set
        return flow_config_from_dict(values)


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    # the core's range check, so that NaN and infinity are refused here as there
    from grouprl.config.checks import _positive as core_positive

    core_positive(key, value, allow_zero)


def validate_flow(config: FlowConfig) -> None:
    """Checks that need more than one field."""
    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    for key, value in (("data.rollout_batch_size", config.data.rollout_batch_size), ("worker.rollout.n", rollout.n),
                       ("worker.rollout.num_steps", rollout.num_steps), ("worker.rollout.height", rollout.height),
                       ("worker.rollout.width", rollout.width), ("worker.rollout.micro_batch_size", rollout.micro_batch_size),
                       ("worker.rollout.val_num_steps", rollout.val_num_steps), ("worker.rollout.val_n", rollout.val_n),
                       ("worker.actor.micro_batch_size", actor.micro_batch_size),
                       ("worker.actor.num_minibatches", actor.num_minibatches), ("worker.actor.ppo_epochs", actor.ppo_epochs),
                       ("algorithm.clip_range", algo.clip_range), ("worker.rollout.guidance_scale", rollout.guidance_scale)):
        _positive(key, value)
    _positive("algorithm.kl_coef", algo.kl_coef, allow_zero=True)
    _positive("worker.rollout.noise_level", rollout.noise_level, allow_zero=True)
    check_task_metric_names(config.trainer.val_metrics)
    config.trainer.health.check("trainer.health")
    if rollout.n < 2:
        raise ConfigError(f"config key 'worker.rollout.n' must be >= 2 for group-relative advantages; got {rollout.n}")
    if rollout.noise_level == 0 and algo.name != "diffusion_nft":
        raise ConfigError(f"config key 'worker.rollout.noise_level' is 0: {algo.name} needs SDE steps to score "
                          "(0 is the ODE, used for validation; diffusion_nft trains on ODE samples)")
    if not 0 < algo.timestep_fraction <= 1:
        raise ConfigError(f"config key 'algorithm.timestep_fraction' must be in (0, 1]; got {algo.timestep_fraction}")
    last = " (worker.rollout.deterministic_last_step keeps the last step out)" if rollout.deterministic_last_step else ""
    if algo.name == "diffusion_nft":
        validate_nft(config)
    elif algo.name == "flow_grpo_fast":
        window, bounds = rollout.sde_window_size, rollout.sde_window_range
        if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1] <= rollout.num_steps:
            raise ConfigError(f"config key 'worker.rollout.sde_window_range' must be [start, end] with 0 <= start < "
                              f"end <= worker.rollout.num_steps ({rollout.num_steps}); got {bounds}")
        length = sde_range(rollout)[1] - bounds[0]
        if not 1 <= window <= length:
            raise ConfigError(f"config key 'worker.rollout.sde_window_size' must be between 1 and the range's "
                              f"length ({length}{last}); got {window}")
    elif not trained_steps(rollout.num_steps, algo.timestep_fraction, rollout.deterministic_last_step):
        raise ConfigError(f"config keys 'algorithm.timestep_fraction' ({algo.timestep_fraction}) and "
                          f"'worker.rollout.num_steps' ({rollout.num_steps}) leave no SDE step to train{last}")
    ema = actor.ema
    if not 0 <= ema.decay < 1:
        raise ConfigError(f"config key 'worker.actor.ema.decay' must be in [0, 1); got {ema.decay}")
    _positive("worker.actor.ema.start_step", ema.start_step, allow_zero=True)
    _positive("worker.actor.ema.update_interval", ema.update_interval)
    if actor.model.max_sequence_length is not None:
        _positive("worker.actor.model.max_sequence_length", actor.model.max_sequence_length)
    if rollout.num_frames is not None:
        _positive("worker.rollout.num_frames", rollout.num_frames)
    if actor.model.lora.rank <= 0:
        raise ConfigError("config key 'worker.actor.model.lora.rank' must be > 0: the flow trainer trains LoRA "
                          "adapters (the reference model is the policy with them off)")
    if not config.worker.reward.functions:
        raise ConfigError("config key 'worker.reward.functions' is empty: name at least one image reward")
    if config.worker.reward.timeout is not None:
        _positive("worker.reward.timeout", config.worker.reward.timeout)
    # a pairwise judge compares the images of a prompt's group, and rewards score a sampler micro-batch at
    # a time (the rows are the prompts' n images in order): a micro-batch must hold whole groups
    for index, spec in enumerate(config.worker.reward.functions):
        kwargs = getattr(spec, "kwargs", None) or {}
        if getattr(spec, "name", None) == "vlm_judge" and kwargs.get("mode") == "unified_reward_pairwise" \
                and rollout.micro_batch_size % rollout.n:
            raise ConfigError(f"config key 'worker.reward.functions[{index}]' judges pairs within a prompt's group, "
                              f"but 'worker.rollout.micro_batch_size' ({rollout.micro_batch_size}) is not a multiple "
                              f"of 'worker.rollout.n' ({rollout.n}): a group would be split between reward calls")
    frames = config.worker.reward.video_frames
    if frames is not None:
        _positive("worker.reward.video_frames", frames)
        if rollout.num_frames is None:
            raise ConfigError(f"config key 'worker.reward.video_frames' is {frames}, but 'worker.rollout.num_frames' "
                              "is not set (an image model): remove it")
        if frames > rollout.num_frames:
            raise ConfigError(f"config key 'worker.reward.video_frames' ({frames}) exceeds the frames per video "
                              f"'worker.rollout.num_frames' ({rollout.num_frames})")
