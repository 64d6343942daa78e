"""Pure tensor functions of GRPO-family training: advantages, policy losses, loss aggregation, KL, filtering,
rollout correction.

Each family has a registry (name -> function) and a dispatcher that selects by name:

- ``ADVANTAGE_ESTIMATORS`` / ``compute_advantages``: grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax, grpo_passk;
- ``POLICY_LOSSES`` / ``compute_policy_loss``: vanilla, gspo, gspo_token, cispo, sapo, geo_mean (GMPO),
  reinforce;
- ``LOSS_AGG_MODES`` / ``aggregate_loss``: token-mean, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm;
- ``KL_ESTIMATORS`` / ``kl_penalty``: k1 (kl), abs, k2 (mse), k3 (low_var_kl); ``unbiased_kl_penalty``
  weighs one by the importance ratio (DeepSeek-V3.2's unbiased estimate).

Several rewards: ``MULTI_OBJECTIVE_AGGREGATIONS`` (sum_then_normalize, normalize_then_sum);
``normalize_then_sum`` is GDPO (each reward normalised by the estimator within its group, weighted
sum, batch renormalisation), ``per_reward_advantages`` each reward's own advantages.

``rollout_importance_weights`` (token or sequence level, truncate or mask) reweights tokens
sampled by a mismatched rollout engine (``compute_policy_loss(..., token_weights=w)``);
``rollout_mismatch_metrics`` gives the mismatch statistics to log. ``off_policy_sequence_mask``
(DeepSeek-V3.2) gives token weights that drop negative-advantage responses the policy has drifted from. verl's spelling of the same
correction: ``threshold_importance_weights`` (TIS / IcePop), ``batch_normalized_weights``,
``rollout_rejection_mask`` (verl's ``rollout_rs`` options) and their metrics;
``compute_bypass_policy_loss`` is verl's bypass mode (old log-probs := the sampler's).

``entropy_bonus`` (the token-mean entropy the loss subtracts, times its coefficient),
``adaptive_entropy_coef`` and ``applied_entropy_coef`` (Skywork-OR1's controller, as TRL's):
entropy regularisation (module ``entropy``).

Group ids may be an integer tensor, a list or numpy array of ints, or strings (verl's uids);
``dense_group_index`` turns any of them into dense long group numbers.

Plug in a new one with ``register_advantage_estimator``, ``register_policy_loss``,
``register_loss_agg_mode`` or ``register_kl_estimator``. An estimator or loss is registered with
its options class (``grouprl.algorithms.options``): the config validates the options a run gives
it by those names (``algorithm.adv_estimator_options`` / ``policy_loss_options``) and the trainer
passes them through.
"""

from grouprl.algorithms.advantages import (
    ADVANTAGE_ESTIMATOR_INPUTS,
    ADVANTAGE_ESTIMATOR_OPTIONS,
    ADVANTAGE_ESTIMATORS,
    GROUP_RELATIVE_ESTIMATORS,
    advantage_estimator_options_class,
    compute_advantages,
    estimator_inputs,
    dense_group_index,
    group_statistics,
    masked_whiten,
    register_advantage_estimator,
)
from grouprl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, register_loss_agg_mode
from grouprl.algorithms.entropy import adaptive_entropy_coef, applied_entropy_coef, entropy_bonus
from grouprl.algorithms.filtering import (
    filter_groups,
    filter_groups_by_mean,
    mask_truncated,
    overlong_penalty,
    reward_std_per_group,
)
from grouprl.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator, unbiased_kl_penalty
from grouprl.algorithms.multi_reward import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    batch_moments,
    normalize_then_sum,
    per_reward_advantages,
)
from grouprl.algorithms.off_policy_masking import off_policy_sequence_mask
from grouprl.algorithms.options import NoOptions
from grouprl.algorithms.policy_losses import (
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    PolicyLossTerms,
    compute_policy_loss,
    policy_loss_options_class,
    register_policy_loss,
)
from grouprl.algorithms.rollout_correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    batch_normalized_weights,
    importance_weight_metrics,
    is_weight_totals,
    off_policy_metrics,
    parse_is_threshold,
    rollout_importance_weights,
    rollout_mismatch_metrics,
    threshold_importance_weights,
)
from grouprl.algorithms.rollout_bypass import BYPASS_LOSS_TYPES, compute_bypass_policy_loss, rollout_correction_terms
from grouprl.algorithms.rollout_rejection import (
    ROLLOUT_RS_OPTIONS,
    parse_rs_options,
    parse_rs_thresholds,
    rollout_rejection_mask,
)

__all__ = [
    "BYPASS_LOSS_TYPES",
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_INPUTS",
    "ADVANTAGE_ESTIMATOR_OPTIONS",
    "NoOptions",
    "POLICY_LOSS_OPTIONS",
    "advantage_estimator_options_class",
    "estimator_inputs",
    "policy_loss_options_class",
    "GROUP_RELATIVE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "ROLLOUT_RS_OPTIONS",
    "PolicyLossTerms",
    "adaptive_entropy_coef",
    "aggregate_loss",
    "applied_entropy_coef",
    "batch_moments",
    "batch_normalized_weights",
    "compute_advantages",
    "compute_bypass_policy_loss",
    "compute_policy_loss",
    "dense_group_index",
    "entropy_bonus",
    "filter_groups",
    "filter_groups_by_mean",
    "group_statistics",
    "importance_weight_metrics",
    "is_weight_totals",
    "kl_penalty",
    "mask_truncated",
    "masked_whiten",
    "normalize_then_sum",
    "off_policy_metrics",
    "off_policy_sequence_mask",
    "overlong_penalty",
    "parse_is_threshold",
    "parse_rs_options",
    "parse_rs_thresholds",
    "per_reward_advantages",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_agg_mode",
    "register_policy_loss",
    "reward_std_per_group",
    "rollout_importance_weights",
    "rollout_correction_terms",
    "rollout_mismatch_metrics",
    "rollout_rejection_mask",
    "threshold_importance_weights",
    "unbiased_kl_penalty",
]
