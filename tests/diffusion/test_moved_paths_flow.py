"""``grouprl.diffusion`` (and ``grouprl.diffusion.sampling``, now ``scheduler``) keep working for one release."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("old, new", [
    ("grouprl.diffusion", "grouprl.domains.diffusion"),
    ("grouprl.diffusion.sampling", "grouprl.domains.diffusion.scheduler"),
    ("grouprl.diffusion.objectives", "grouprl.domains.diffusion.objectives"),
])
def test_old_diffusion_paths_are_the_new_modules_and_warn(old, new):
    code = (f"import importlib, warnings; warnings.simplefilter('always'); "
            f"print(importlib.import_module({old!r}).__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == new
    assert f"{old} has moved to {new}" in run.stderr


def test_names_from_the_old_package_resolve():
    code = "from grouprl.diffusion import sde_step; print(sde_step.__module__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "grouprl.domains.diffusion.scheduler"
