"""The dependency rule of grouprl's layout (docs/design.md), checked on every module's own imports.

1. Nothing outside ``grouprl/domains/`` imports ``grouprl.domains``: not at the top, not
   inside a function, not through an import string (``importlib.import_module``, a
   registry's ``"module:attr"`` reference, an entry point). The one exception is the
   old import paths kept for a release (:mod:`grouprl.moved`): a module whose whole body
   is one ``alias_package("old", "new")`` call.
2. No domain imports another. ``grouprl.domains.demos`` (what the demos share) is no domain:
   every domain may import it, and it imports no domain.
3. Inside the core, a module imports only from its own layer or the layers above it
   (``CORE_LAYERS``, top first); config's cross-field checks may look up registries.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "grouprl"

# top first: each layer may import from itself and the layers before it
CORE_LAYERS = [
    ["grouprl.registry", "grouprl.files", "grouprl.moved", "grouprl.errors", "grouprl.streams"],
    ["grouprl.config"],
    ["grouprl.algorithms"],
    ["grouprl.rewards"],
    ["grouprl.data"],
    ["grouprl.models"],
    ["grouprl.rollout"],
    ["grouprl.trainer"],
    ["grouprl.report"],
    ["grouprl.cli", "grouprl.__main__", "grouprl.doctor", "grouprl", "grouprl.planning"],
]
# config's cross-field checks read registries that live further down (``checks.validate``)
REGISTRY_LOOKUPS = {"grouprl.config.algorithm_options": {"grouprl.algorithms"},
                    "grouprl.config.checks": {"grouprl.algorithms", "grouprl.rollout.engine",
                                               "grouprl.trainer.task_metrics", "grouprl.trainer.trackers"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(tree: ast.Module, name: str) -> list[tuple[int, str]]:
    """(line, module) for every import statement, anywhere in the module, and every string
    constant that looks like a grouprl module path (import strings, ``module:attr`` references)."""
    found = []
    package = name if tree_is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c`: c is a module of a.b or a name in it; either way a.b.c's layer is a.b's
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if text.startswith("grouprl.") and " " not in text:
                found.append((node.lineno, text.split(":")[0]))
    return found


def tree_is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def is_moved_alias(tree: ast.Module) -> bool:
    """A module kept at an old path: a docstring, ``from grouprl.moved import alias_package`` and one call."""
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 2 or not isinstance(body[0], ast.ImportFrom) or body[0].module != "grouprl.moved":
        return False
    call = body[1].value if isinstance(body[1], ast.Expr) else None
    return (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "alias_package"
            and all(isinstance(a, ast.Constant) or getattr(a, "id", None) == "__name__" for a in call.args))


# shared by the domains' demos: importable from every domain, importing none
SHARED = "grouprl.domains.demos"


def domain_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "domains" and not is_shared(name) else None


def is_shared(name: str) -> bool:
    return name == SHARED or name.startswith(SHARED + ".")


def layer_of(name: str) -> int | None:
    for i, layer in enumerate(CORE_LAYERS):
        for prefix in layer:
            if name == prefix or (prefix != "grouprl" and name.startswith(prefix + ".")):
                return i
    return None


def violations(mods: dict[str, ast.Module]) -> list[str]:
    out: list[str] = []
    for name, tree in mods.items():
        if is_moved_alias(tree):
            continue
        mine = domain_of(name)
        in_domains = name.startswith("grouprl.domains")
        for line, target in imported_names(tree, name):
            if not (target == "grouprl" or target.startswith("grouprl.")):
                continue
            theirs = domain_of(target)
            if target.startswith("grouprl.domains") and not in_domains:
                out.append(f"{name}:{line} imports {target}: the core may not import a domain")
            elif is_shared(name) and theirs:
                out.append(f"{name}:{line} imports {target}: {SHARED} may not import a domain")
            elif mine and theirs and theirs != mine:
                out.append(f"{name}:{line} imports {target}: a domain may not import another ({mine} -> {theirs})")
            elif not in_domains and not target.startswith("grouprl.domains"):
                here, there = layer_of(name), layer_of(target)
                allowed = any(target == r or target.startswith(r + ".") for r in REGISTRY_LOOKUPS.get(name, ()))
                if here is not None and there is not None and there > here and not allowed:
                    out.append(f"{name}:{line} imports {target}: layer {CORE_LAYERS[there][0]} is below "
                               f"{CORE_LAYERS[here][0]}")
    return list(dict.fromkeys(out))


def test_every_module_is_in_a_layer_or_a_domain():
    # an old import path kept for a release (grouprl.diffusion) is in no layer: it only points to the new one
    unplaced = [n for n, tree in modules().items()
                if layer_of(n) is None and not n.startswith("grouprl.domains") and not is_moved_alias(tree)]
    assert not unplaced


def test_the_core_imports_no_domain_and_layers_hold():
    assert violations(modules()) == []


@pytest.mark.parametrize("source, planted", [
    ("grouprl.trainer.update", "import grouprl.domains.radiology.edits\n"),
    ("grouprl.rewards.contract", "def f():\n    from grouprl.domains.diffusion import scheduler\n"),
    ("grouprl.cli", "X = 'grouprl.domains.reasoning.demo:run_guided_demo'\n"),
    ("grouprl.domains.diffusion.trainer", "from grouprl.domains.radiology import findings\n"),
    ("grouprl.domains.demos.curves", "from grouprl.domains.reasoning import demo\n"),
    ("grouprl.config", "from grouprl.trainer import checkpoint\n"),
])
def test_a_planted_import_is_caught(source, planted):
    mods = modules()
    assert source in mods
    text = ast.unparse(mods[source])  # line numbers as the planted version will have them
    mods[source] = ast.parse(text)
    before = set(violations(mods))
    mods[source] = ast.parse(text + "\n" + planted)
    assert len(set(violations(mods)) - before) == 1


def test_tests_of_the_core_import_no_domain():
    core_tests = Path(__file__).resolve().parent
    offenders = []
    # the core's tests, and the fixtures every test shares (a domain's own: tests/<domain>/conftest.py)
    for path in sorted(core_tests.rglob("*.py")) + [core_tests.parent / "conftest.py"]:
        if path == Path(__file__).resolve():
            continue  # this file names the domains as data, to find imports of them
        for line, target in imported_names(ast.parse(path.read_text()), "tests"):
            if target.startswith("grouprl.domains"):
                offenders.append(f"{path.relative_to(core_tests.parent)}:{line} {target}")
    assert offenders == []
