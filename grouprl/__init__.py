"""grouprl: group-relative RL post-training (GRPO family) for vision-language and text models."""

__version__ = "0.1.0"
