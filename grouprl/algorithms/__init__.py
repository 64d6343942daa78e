"""Pure tensor functions of GRPO-family training: advantages, policy losses, loss aggregation, KL, filtering,
rollout correction.

Each family has a registry (name -> function) and a dispatcher that selects by name:

- ``ADVANTAGE_ESTIMATORS`` / ``compute_advantages``: grpo, rloo, reinforce_plus_plus,
  reinforce_plus_plus_baseline, remax, grpo_passk;
- ``POLICY_LOSSES`` / ``compute_policy_loss``: vanilla, gspo, gspo_token, cispo, sapo, geo_mean (GMPO);
- ``LOSS_AGG_MODES`` / ``aggregate_loss``: token-mean, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm;
- ``KL_ESTIMATORS`` / ``kl_penalty``: k1 (kl), abs, k2 (mse), k3 (low_var_kl); ``unbiased_kl_penalty``
  weighs one by the importance ratio (DeepSeek-V3.2's unbiased estimate).

``rollout_importance_weights`` (token or sequence level, truncate or mask) reweights tokens
sampled by a mismatched rollout engine (``compute_policy_loss(..., token_weights=w)``);
``rollout_mismatch_metrics`` gives the mismatch statistics to log. ``off_policy_sequence_mask``
(DeepSeek-V3.2) gives token weights that drop negative-advantage responses the policy has drifted from.

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
from grouprl.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator, unbiased_kl_penalty
from grouprl.algorithms.off_policy_masking import off_policy_sequence_mask
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
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "PolicyLossTerms",
    "aggregate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "dense_group_index",
    "filter_groups",
    "filter_groups_by_mean",
    "group_statistics",
    "kl_penalty",
    "mask_truncated",
    "masked_whiten",
    "off_policy_sequence_mask",
    "overlong_penalty",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_agg_mode",
    "register_policy_loss",
    "reward_std_per_group",
    "rollout_importance_weights",
    "rollout_mismatch_metrics",
    "unbiased_kl_penalty",
]
