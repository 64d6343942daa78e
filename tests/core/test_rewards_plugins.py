"""Domain rewards are plugins: the core imports no domain code, and a plugin that fails to load is named.

The radiology plugin's names, found without importing it first: tests/radiology/test_reward_plugin.py.
"""

from __future__ import annotations

import importlib.metadata

import pytest

import grouprl.registry
from grouprl.rewards import RewardLoadError, get_reward, registry


def test_importing_the_rewards_core_imports_no_domain_package(run_fresh):
    seen = run_fresh("""
        import json, sys
        from pathlib import Path
        import grouprl.rewards
        domains = Path(grouprl.__file__).parent / "domains"  # every domain package lives there
        print(json.dumps([name for name, module in list(sys.modules.items())
                          if Path(getattr(module, "__file__", None) or "/").is_relative_to(domains)]))
    """)
    assert seen == []


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
