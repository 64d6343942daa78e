"""GREEN's judge on the one chat client (grouprl.rewards.chat_endpoint; its own tests:
tests/core/test_chat_endpoint.py)."""

from __future__ import annotations

import sys

import pytest

from grouprl.domains.radiology.rewards.green import GreenJudge


def test_a_missing_openai_names_the_green_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai now raises ImportError
    with pytest.raises(ImportError, match=r"needs the openai client: pip install 'grouprl\[green\]'"):
        GreenJudge("http://h/v1", "m")
