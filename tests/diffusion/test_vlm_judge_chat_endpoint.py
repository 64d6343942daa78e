"""The image reward vlm_judge on the one chat client (grouprl.rewards.chat_endpoint; its own tests:
tests/core/test_chat_endpoint.py; the judge's scoring: tests/diffusion/test_image_rewards.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from grouprl.domains.diffusion.rewards import vlm_judge_reward


def test_a_missing_openai_names_the_judge_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai now raises ImportError
    with pytest.raises(ImportError, match=r"needs the openai client: pip install 'grouprl\[judge\]'"):
        asyncio.run(vlm_judge_reward([], [], base_url="http://h/v1"))
