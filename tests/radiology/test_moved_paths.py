"""Import paths from before the core/domain split keep working for one release, with a warning naming the new path."""

import importlib
import subprocess
import sys

import pytest

from grouprl.rewards.registry import get_reward


def fresh_import(module: str) -> subprocess.CompletedProcess:
    """Import ``module`` in a new interpreter (the alias warns once per process), warnings shown."""
    code = (f"import importlib, warnings; warnings.simplefilter('always'); m = importlib.import_module({module!r}); "
            "print(m.__name__)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


@pytest.mark.parametrize("old, new", [
    ("grouprl.rewards.radiology", "grouprl.domains.radiology.rewards"),
    ("grouprl.rewards.radiology.kg", "grouprl.domains.radiology.rewards.kg"),
    ("grouprl.rewards.radiology.backends.chexbert", "grouprl.domains.radiology.rewards.backends.chexbert"),
    ("grouprl.rewards.findings", "grouprl.domains.radiology.findings"),
])
def test_old_radiology_paths_are_the_new_modules_and_warn(old, new):
    run = fresh_import(old)
    assert run.stdout.strip() == new
    assert "FutureWarning" in run.stderr and f"{old} has moved to {new}" in run.stderr


def forget(old: str) -> None:
    """Drop ``old`` from this process's modules, so that importing it again runs the alias (and warns)."""
    sys.modules.pop(old, None)


def test_old_paths_give_the_same_objects_so_nothing_registers_twice():
    forget("grouprl.rewards.radiology.kg")
    with pytest.warns(FutureWarning):
        old = importlib.import_module("grouprl.rewards.radiology.kg")
    new = importlib.import_module("grouprl.domains.radiology.rewards.kg")
    assert old is new


def test_a_config_naming_an_old_module_path_still_loads_its_reward():
    forget("grouprl.rewards.findings")
    with pytest.warns(FutureWarning, match="grouprl.domains.radiology"):
        old = get_reward("grouprl.rewards.findings:finding_f1_reward")
    assert old is get_reward("grouprl.domains.radiology.findings:finding_f1_reward")
