"""Domain rewards are plugins: the core imports no radiology code, the registry loads it on demand."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap

import pytest

import grouprl.registry
from grouprl.rewards import RewardLoadError, get_reward, registry

CLINICAL = ("editgrpo_composite", "kg_consistency", "radgraphf1", "cxb14micro", "ratescore", "answer_set_f1",
            "finding_f1", "finding_accuracy")
DOMAIN_MODULES = ("grouprl.domains.radiology.rewards", "grouprl.domains.radiology.findings")


def run_fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (nothing imported yet); it prints one JSON object."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_rewards_core_imports_no_domain_package():
    seen = run_fresh(f"""
        import json, sys
        import grouprl.rewards
        print(json.dumps([m for m in {DOMAIN_MODULES!r} if m in sys.modules]))
    """)
    assert seen == []


def test_a_plugin_reward_name_works_without_importing_its_package_first():
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


def test_registered_rewards_lists_the_plugins_names():
    names = run_fresh("""
        import json
        from grouprl.rewards import registered_rewards
        print(json.dumps(registered_rewards()))
    """)
    assert set(CLINICAL) <= set(names)
    assert {"accuracy", "format", "length"} <= set(names)


def test_unknown_name_suggests_plugin_names():
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


def test_a_plugin_that_fails_to_import_is_an_error_naming_it(monkeypatch):
    broken = importlib.metadata.EntryPoint(name="broken_domain", value="grouprl_no_such_module.rewards",
                                           group=registry.PLUGIN_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [broken])
    monkeypatch.setattr(grouprl.registry, "_PLUGINS", {})
    monkeypatch.setattr(grouprl.registry, "_PLUGINS_DONE", False)
    expected = r"grouprl plugin 'broken_domain' \(grouprl_no_such_module.rewards.*failed to import: ModuleNotFound"
    with pytest.raises(RewardLoadError, match=expected):
        get_reward("no_such_reward_name")
    with pytest.raises(RewardLoadError, match="broken_domain"):  # tried again, not skipped from then on
        registry.registered_rewards()
    assert get_reward("accuracy") is not None  # registered names need no plugin
