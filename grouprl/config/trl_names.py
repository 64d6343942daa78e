"""TRL's ``GRPOConfig`` names (TRL 1.16, its ``TrainingArguments`` fields included) and grouprl's keys: one table.

A user coming from TRL writes ``num_generations=8`` or ``beta: 0.04``; grouprl's schema calls
these ``worker.rollout.n`` and ``algorithm.kl_coef``. Nothing here is read as a value: a TRL
name in a config is still an unknown key, but its error names the grouprl key to write
(:func:`grouprl.config.load.port_hint`), ahead of any spelling suggestion, which would
point elsewhere (``num_generations`` is spelled like ``trainer.val_generations_to_log``).

Each entry holds the TRL field, the grouprl key, how values translate (``values``, said in the
error) and what else differs (``differs``, for the documentation's table,
:func:`markdown_table`). Only names with a grouprl counterpart are listed; a test checks every
``trl`` name against the installed TRL's ``GRPOConfig`` and every ``key`` against the schema.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TRLName:
    trl: str  # the GRPOConfig (or TrainingArguments) field
    key: str  # grouprl's dotted key
    values: str = ""  # how TRL's values are written in grouprl, when they are spelled differently
    differs: str = ""  # what else differs in meaning (documentation only)


TRL_NAMES: tuple[TRLName, ...] = (
    # ---------------------------------------------------------------- generation
    TRLName("num_generations", "worker.rollout.n"),
    TRLName("num_generations_eval", "worker.rollout.val_n"),
    TRLName("max_completion_length", "data.max_response_length"),
    TRLName("temperature", "worker.rollout.temperature"),
    TRLName("top_p", "worker.rollout.top_p"),
    TRLName("top_k", "worker.rollout.top_k"),
    TRLName("use_vllm", "worker.rollout.engine", "use_vllm: true is engine: vllm",
            "colocated only (no `vllm_mode: server`)"),
    TRLName("vllm_mode", "worker.rollout.engine", "colocate is engine: vllm; there is no server mode"),
    TRLName("vllm_gpu_memory_utilization", "worker.rollout.gpu_memory_utilization"),
    TRLName("vllm_tensor_parallel_size", "worker.rollout.tensor_parallel_size"),
    TRLName("max_tool_calling_iterations", "worker.rollout.multi_turn.max_turns",
            "max_tool_calling_iterations: K is max_turns: K + 1",
            "counts policy turns (the first included), not tool rounds; null (no limit) has no counterpart"),
    TRLName("vllm_enable_sleep_mode", "worker.rollout.enable_sleep_mode"),
    TRLName("vllm_importance_sampling_correction", "algorithm.rollout_correction.enable",
            differs="on by default with vLLM"),
    TRLName("vllm_importance_sampling_mode", "algorithm.rollout_correction.level",
            "token_/sequence_ is level, _truncate/_mask is algorithm.rollout_correction.mode"),
    TRLName("vllm_importance_sampling_cap", "algorithm.rollout_correction.clip_max"),
    TRLName("vllm_importance_sampling_clip_max", "algorithm.rollout_correction.clip_max"),
    TRLName("vllm_importance_sampling_clip_min", "algorithm.rollout_correction.clip_min"),
    TRLName("chat_template_kwargs", "data.chat_template_kwargs"),
    # ---------------------------------------------------------------- the objective
    TRLName("beta", "algorithm.kl_coef", "with algorithm.use_kl_loss: true for TRL's KL loss",
            "TRL's KL is k3; grouprl's default `low_var_kl` is k3 clipped to [-10, 10] (`kl_penalty: k3` names "
            "the same clipped estimator); `use_kl_loss: false` puts the KL in the reward instead"),
    TRLName("epsilon", "worker.actor.clip_ratio_low", differs="TRL's `epsilon` is both ends unless `epsilon_high`"),
    TRLName("epsilon_high", "worker.actor.clip_ratio_high", differs="grouprl's default is 0.3, TRL's `epsilon` (0.2)"),
    TRLName("delta", "worker.actor.clip_ratio_dual"),
    TRLName("num_iterations", "worker.actor.ppo_epochs"),
    TRLName("loss_type", "algorithm.loss_agg_mode",
            "grpo is seq-mean-token-mean, dr_grpo seq-mean-token-sum-norm, dapo token-mean",
            "`bnpo` has no exact counterpart"),
    TRLName("scale_rewards", "algorithm.adv_std_level", "group, batch and none as in TRL",
            "eps 1e-6 (TRL's 1e-4); the batch std is over every process's rows, as TRL gathers the batch"),
    TRLName("importance_sampling_level", "algorithm.policy_loss", "token is vanilla, sequence is gspo",
            "GSPO's range is `worker.actor.gspo.clip_ratio_low/high` (3e-4 / 4e-4), not epsilon"),
    TRLName("sapo_temperature_pos", "worker.actor.sapo.tau_pos"),
    TRLName("sapo_temperature_neg", "worker.actor.sapo.tau_neg"),
    TRLName("mask_truncated_completions", "algorithm.mask_truncated_completions"),
    TRLName("entropy_coef", "worker.actor.entropy_coeff",
            differs="TRL's bonus is each micro-batch's token mean; grouprl's the mini-batch's (exact under accumulation)"),
    TRLName("use_adaptive_entropy", "worker.actor.entropy_control.adaptive"),
    TRLName("entropy_coef_min", "worker.actor.entropy_control.coef_min"),
    TRLName("entropy_coef_max", "worker.actor.entropy_control.coef_max"),
    TRLName("entropy_coef_delta", "worker.actor.entropy_control.delta"),
    TRLName("entropy_target", "worker.actor.entropy_control.target",
            differs="a step with no loss token leaves the coefficient as it is (TRL reads its entropy as 0)"),
    TRLName("off_policy_mask_threshold", "algorithm.off_policy_sequence_masking.delta",
            differs="the sampler is the engine's log-probs when the run has them, else the old policy's, as TRL"),
    TRLName("use_bias_correction_kl", "algorithm.unbiased_kl",
            differs="TRL's default is true, grouprl's false; the ratio is per token (TRL's follows "
                    "`importance_sampling_level`), the KL is `algorithm.kl_penalty` (TRL's k3, unclipped)"),
    TRLName("reward_weights", "worker.reward.functions", "each function's weight sits with it: "
            "worker.reward.functions[i].weight"),
    TRLName("multi_objective_aggregation", "algorithm.multi_objective_aggregation",
            "sum_then_normalize and normalize_then_sum as in TRL",
            "eps 1e-6 (TRL's 1e-4); each reward goes through algorithm.adv_estimator (TRL: GRPO's group std)"),
    # ---------------------------------------------------------------- TrainingArguments
    TRLName("learning_rate", "worker.actor.optim.lr"),
    TRLName("lr_scheduler_type", "worker.actor.optim.lr_scheduler_type"),
    TRLName("weight_decay", "worker.actor.optim.weight_decay"),
    TRLName("adam_beta1", "worker.actor.optim.betas", "betas: [adam_beta1, adam_beta2]"),
    TRLName("adam_beta2", "worker.actor.optim.betas", "betas: [adam_beta1, adam_beta2]"),
    TRLName("max_grad_norm", "worker.actor.max_grad_norm"),
    TRLName("gradient_checkpointing", "worker.actor.model.enable_gradient_checkpointing"),
    TRLName("bf16", "worker.actor.model.dtype", "bf16: true is dtype: bfloat16"),
    TRLName("num_train_epochs", "trainer.total_epochs"),
    TRLName("max_steps", "trainer.max_steps"),
    TRLName("output_dir", "trainer.output_dir"),
    TRLName("run_name", "trainer.experiment_name"),
    TRLName("seed", "trainer.seed"),
    TRLName("save_steps", "trainer.save_freq"),
    TRLName("save_total_limit", "trainer.save_limit"),
    TRLName("eval_steps", "trainer.val_freq"),
    TRLName("resume_from_checkpoint", "trainer.resume", "a path, or auto for the newest checkpoint"),
    TRLName("report_to", "trainer.logger", "console, jsonl, tensorboard, wandb, mlflow or trackio",
            "no comet, neptune or others"),
)

BY_TRL_NAME: dict[str, TRLName] = {entry.trl: entry for entry in TRL_NAMES}


def markdown_table() -> str:
    """The table for the documentation: TRL's name, grouprl's key, what differs (values and meaning)."""
    rows = ["| TRL `GRPOConfig` | grouprl key | what differs |", "|---|---|---|"]
    for entry in TRL_NAMES:
        differs = "; ".join(part for part in (entry.values, entry.differs) if part) or "-"
        rows.append(f"| `{entry.trl}` | `{entry.key}` | {differs} |")
    return "\n".join(rows)
