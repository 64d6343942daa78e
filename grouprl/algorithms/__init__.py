"""Pure tensor functions of GRPO-family training: advantages, policy losses, loss aggregation, KL, filtering,
rollout correction.

Each family has a registry (name -> function) and a dispatcher that selects by name:

- ``ADVANTAGE_ESTIMATORS`` / ``compute_advantages``: grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax, grpo_passk;
- ``POLICY_LOSSES`` / ``compute_policy_loss``: vanilla, gspo, gspo_token, cispo, sapo;
- ``LOSS_AGG_MODES`` / ``aggregate_loss``: token-mean, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm;
- ``KL_ESTIMATORS`` / ``kl_penalty``: k1 (kl), abs, k2 (mse), k3 (low_var_kl).

Several rewards: ``MULTI_OBJECTIVE_AGGREGATIONS`` (sum_then_normalize, normalize_then_sum);
``normalize_then_sum`` is GDPO (each reward normalised by the estimator within its group, weighted
sum, batch renormalisation), ``per_reward_advantages`` each reward's own advantages.

``rollout_importance_weights`` (token or sequence level, truncate or mask) reweights tokens
sampled by a mismatched rollout engine (``compute_policy_loss(..., token_weights=w)``);
``rollout_mismatch_metrics`` gives the mismatch statistics to log.

Group ids may be an integer tensor, a list or numpy array of ints, or strings (verl's uids);
``dense_group_index`` turns any of them into dense long group numbers.

Plug in a new one with ``register_advantage_estimator``, ``register_policy_loss``,
``register_loss_agg_mode`` or ``register_kl_estimator``.
"""

from grouprl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_RELATIVE_ESTIMATORS,
    compute_advantages,
    dense_group_index,
    group_statistics,
    masked_whiten,
    register_advantage_estimator,
)
from grouprl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, register_loss_agg_mode
from grouprl.algorithms.filtering import (
    filter_groups,
    filter_groups_by_mean,
    mask_truncated,
    overlong_penalty,
    reward_std_per_group,
)
from grouprl.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from grouprl.algorithms.multi_reward import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    batch_moments,
    normalize_then_sum,
    per_reward_advantages,
)
from grouprl.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossTerms,
    compute_policy_loss,
    register_policy_loss,
)
from grouprl.algorithms.rollout_correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    rollout_importance_weights,
    rollout_mismatch_metrics,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_RELATIVE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "PolicyLossTerms",
    "aggregate_loss",
    "batch_moments",
    "compute_advantages",
    "compute_policy_loss",
    "dense_group_index",
    "filter_groups",
    "filter_groups_by_mean",
    "group_statistics",
    "kl_penalty",
    "mask_truncated",
    "masked_whiten",
    "normalize_then_sum",
    "overlong_penalty",
    "per_reward_advantages",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_agg_mode",
    "register_policy_loss",
    "reward_std_per_group",
    "rollout_importance_weights",
    "rollout_mismatch_metrics",
]
