"""grouprl.domains.reasoning exports its public names at its top, each imported on first use."""

import importlib
import subprocess
import sys

import pytest


def test_every_exported_name_resolves_to_its_module():
    package = importlib.import_module("grouprl.domains.reasoning")
    assert package.__all__
    for name in package.__all__:
        obj = getattr(package, name)
        assert getattr(obj, "__name__", name) == name
        assert obj.__module__.startswith("grouprl.domains.reasoning")
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        package.not_exported


def test_importing_the_package_imports_none_of_its_modules():
    code = ("import sys, grouprl.domains.reasoning; "
            "print(sorted(m for m in sys.modules if m.startswith('grouprl.domains.reasoning.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
