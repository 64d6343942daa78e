"""The diffusion domain's parts, registered by name (the ``diffusion`` entry point of ``grouprl.plugins``).

The image rewards (``ocr``, ``vlm_judge``, ``image_brightness``, ``shapes``; the preference models
``pickscore``, ``hpsv2``, ``image_reward``, ``clip_score``, ``aesthetic``), the validation
metric ``shapes`` (the demo's held-out comparison), the flow
trainer as the trainer kind ``flow`` (a config file with ``kind: flow``) and the
Flow-GRPO-Fast demo as `grouprl demo --flow`. Registered lazily: naming a part imports
its module, so loading the plugin imports neither diffusers nor the image rewards.
"""

from grouprl.cli import DEMOS, Demo
from grouprl.rewards.registry import register_image_reward
from grouprl.trainer.kinds import TRAINER_KINDS, TrainerKind
from grouprl.trainer.task_metrics import TASK_METRICS

# The image rewards (grouprl.domains.diffusion.rewards), by the names configs use.
register_image_reward("ocr", "grouprl.domains.diffusion.rewards:ocr_reward")
register_image_reward("vlm_judge", "grouprl.domains.diffusion.rewards:vlm_judge_reward")
register_image_reward("image_brightness", "grouprl.domains.diffusion.rewards:image_brightness_reward")
register_image_reward("shapes", "grouprl.domains.diffusion.rewards:shapes_task_reward")
# Preference models with local weights (grouprl.domains.diffusion.preference_rewards).
for _name, _function in (("pickscore", "pickscore_reward"), ("hpsv2", "hpsv2_reward"),
                         ("image_reward", "image_reward_reward"), ("clip_score", "clip_score_reward"),
                         ("aesthetic", "aesthetic_reward")):
    register_image_reward(_name, f"grouprl.domains.diffusion.preference_rewards:{_function}")
del _name, _function
TASK_METRICS.register("shapes", "grouprl.domains.diffusion.shapes:shapes_metric")

TRAINER_KINDS.register("flow", TrainerKind(
    config="grouprl.domains.diffusion.config:flow_config_from_dict",
    trainer="grouprl.domains.diffusion.trainer:flow_trainer",
    description="Flow-GRPO and its family on flow-matching image models (needs grouprl[diffusion])"))
DEMOS.register("flow", Demo(
    run="grouprl.domains.diffusion.demo:run_flow_demo", flag="--flow",
    help="Flow-GRPO-Fast on a tiny SD3 transformer drawing coloured squares (needs grouprl[diffusion]): "
         "pretrain, then RL against a rule reward, compared on held-out prompts (default out runs/demo-flow); "
         "with --compare: Flow-GRPO-Fast and DiffusionNFT for the same training time (default out "
         "runs/demo-flow-compare)",
    combined={"--compare": "grouprl.domains.diffusion.demo:run_flow_compare"},
    options=[("--model", {"default": "sd3", "choices": ["sd3", "flux", "qwen-image"],
                          "help": "the flow demo's tiny model: sd3 (default), or a tiny pixel-space stand-in of "
                                  "FLUX.1 (schnell's kind) or Qwen-Image"})]))
