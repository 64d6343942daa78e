"""Group-relative RL for flow-matching image models: Flow-GRPO, Flow-GRPO-Fast, GRPO-Guard and DiffusionNFT.

diffusers' split: ``models`` (the transformer, text encoders and VAE, loaded from a
local path), ``scheduler`` (the SDE / CPS step with its log-probability, pure
functions), ``pipeline`` (the loop that runs them), ``objectives`` (advantages, the
clipped ratio loss, KL, GRPO-Guard), ``nft`` (DiffusionNFT's loss), ``rewards`` (image
rewards), ``batches`` (a step's images and the update's rows) and ``trainer`` (one trainer
per algorithm on a shared base).
The sampling math needs only torch; everything that loads a model needs
``pip install 'grouprl[diffusion]'``.
"""

from __future__ import annotations

from grouprl.registry import lazy_attributes

# public name -> the module that defines it; imported on first use, so `grouprl.domains.diffusion.sde_step`
# does not import diffusers
_EXPORTS = {
    "sde_step": "grouprl.domains.diffusion.scheduler",
    "SDEStepOutput": "grouprl.domains.diffusion.scheduler",
    "cfg_velocity": "grouprl.domains.diffusion.scheduler",
    "FlowConfig": "grouprl.domains.diffusion.config",
    "load_flow_config": "grouprl.domains.diffusion.config",
    "FlowTrainer": "grouprl.domains.diffusion.trainer",
    "FlowGRPOTrainer": "grouprl.domains.diffusion.trainer",
    "DiffusionNFTTrainer": "grouprl.domains.diffusion.trainer",
    "flow_trainer": "grouprl.domains.diffusion.trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
