"""The radiology plugin's rewards by name: the registry loads the plugin on demand (the core side:
tests/core/test_rewards_plugins.py)."""

from __future__ import annotations

import importlib.metadata
import re

from grouprl.rewards import registry

CLINICAL = ("editgrpo_composite", "kg_consistency", "radgraphf1", "cxb14micro", "ratescore", "answer_set_f1",
            "finding_f1", "finding_accuracy")


def test_a_plugin_reward_name_works_without_importing_its_package_first(run_fresh):
    seen = run_fresh("""
        import json, sys
        from grouprl.rewards import RewardSet, get_reward
        fn = get_reward("editgrpo_composite")
        loaded = "grouprl.domains.radiology.rewards" in sys.modules
        result = RewardSet.from_specs(["finding_f1", "kg_consistency"]).score(
            ["p"], ["Mild cardiomegaly. No pleural effusion."], {"answer": ["Cardiomegaly. No effusion."]})
        print(json.dumps({"module": fn.__module__, "loaded": loaded, "keys": sorted(result.components)}))
    """)
    assert seen["module"].startswith("grouprl.domains.radiology.rewards")
    assert seen["loaded"] is True
    assert seen["keys"] == ["finding_f1", "kg_consistency"]


def test_registered_rewards_lists_the_plugins_names(run_fresh):
    names = run_fresh("""
        import json
        from grouprl.rewards import registered_rewards
        print(json.dumps(registered_rewards()))
    """)
    assert set(CLINICAL) <= set(names)
    assert {"accuracy", "format", "length"} <= set(names)


def test_unknown_name_suggests_plugin_names(run_fresh):
    message = run_fresh("""
        import json
        from grouprl.rewards import RewardLoadError, get_reward
        try:
            get_reward("editgrpo_composit")
        except RewardLoadError as exc:
            print(json.dumps(str(exc)))
    """)
    assert "unknown reward 'editgrpo_composit'" in message
    assert "Did you mean editgrpo_composite" in message
    assert re.search(r"plugins loaded: [a-z, ]*\bradiology\b", message)


def test_installed_metadata_declares_the_plugins():
    # What `pip install -e .` wrote from pyproject.toml; a stale install lacks them.
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=registry.PLUGIN_GROUP)}
    assert plugins.get("radiology") == "grouprl.domains.radiology.plugin"
    assert plugins.get("diffusion") == "grouprl.domains.diffusion.plugin"
    assert plugins.get("reasoning") == "grouprl.domains.reasoning.plugin"
