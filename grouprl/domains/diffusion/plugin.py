"""The diffusion domain's parts, registered by name (the ``diffusion`` entry point of ``grouprl.plugins``).

Registered lazily: naming a part imports its module, so loading the plugin imports
neither diffusers nor the image rewards.
"""

from grouprl.rewards.registry import register_image_reward

# The image rewards (grouprl.domains.diffusion.rewards), by the names configs use.
register_image_reward("ocr", "grouprl.domains.diffusion.rewards:ocr_reward")
register_image_reward("vlm_judge", "grouprl.domains.diffusion.rewards:vlm_judge_reward")
register_image_reward("image_brightness", "grouprl.domains.diffusion.rewards:image_brightness_reward")
register_image_reward("shapes", "grouprl.domains.diffusion.rewards:shapes_task_reward")
