"""The demos' shared modules moved out of the core's run loop; their old paths work for one release."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("old, new", [
    ("grouprl.trainer.curves", "grouprl.domains.demos.curves"),
    ("grouprl.trainer.seed_stats", "grouprl.domains.demos.seed_stats"),
    ("grouprl.domains.radiology.seed_stats", "grouprl.domains.demos.seed_stats"),
])
def test_old_demo_module_paths_are_the_new_modules_and_warn(old, new):
    code = (f"import importlib, warnings; warnings.simplefilter('always'); "
            f"m = importlib.import_module({old!r}); import {new}; print(m.__name__, m is {new})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == [new, "True"]
    assert "FutureWarning" in run.stderr and f"{old} has moved to {new}" in run.stderr
