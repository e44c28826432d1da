"""The package rules of the code base, checked on the import graph drawn from the source (every import,
module-level or inside a function): who may import whom, no import cycles between files, and no product
module over MAX_LINES lines without a reason written at its top. And the test tree's own shape: tiers
that mirror the packages, one place for harnesses.

    common/, models/                                  leaves: nothing project-internal
    replay_buffer/, weight_bus/, generator_fleet/,    components: leaves and the data / weight-route
    trainer/                                          contracts only; trainer and fleet never each other
    jobspec/                                          composes the components' config sections
    model_zoo/                                        model recipes: the one package above trainer + fleet
    slipstream/                                       the control plane: job/ (one job's runtime) below
                                                      cluster/ (the control API, the store's users) below cli/
"""

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "common",
    "models",
    "replay_buffer",
    "weight_bus",
    "generator_fleet",
    "trainer",
    "jobspec",
    "model_zoo",
    "slipstream",
]
ALLOWED = {  # package -> the project packages it may import
    "common": set(),
    "models": {"common"},
    "replay_buffer": {"common"},
    "weight_bus": {"common", "models", "replay_buffer"},
    "generator_fleet": {"common", "models", "replay_buffer", "weight_bus"},
    "trainer": {"common", "models", "replay_buffer", "weight_bus"},
    "jobspec": {"common", "models", "replay_buffer", "weight_bus", "generator_fleet", "trainer"},
    "model_zoo": {"common", "models", "generator_fleet", "trainer", "jobspec"},
    "slipstream": set(PACKAGES) - {"slipstream"},
}
MAX_LINES = 600
LONG_MARK = "Long module:"  # a comment in the first 30 lines that says why a module is longer


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (resolved to the deepest module that exists)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] not in PACKAGES:
            continue
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.add(".".join(parts))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_packages_import_only_what_they_may():
    wrong = [
        f"{m} imports {dep}"
        for m, deps in _graph().items()
        for dep in sorted(deps)
        if (a := m.split(".")[0]) != (b := dep.split(".")[0]) and b not in ALLOWED[a]
    ]
    assert not wrong, "\n".join(wrong)


FLOORS_WITHIN = {  # inside the control plane: the job runtime below the cluster and the command line
    "slipstream.job": {"slipstream.cluster", "slipstream.cli"},
    "slipstream.cluster": {"slipstream.cli"},
}
"""Sub-package -> the sub-packages of its package it must not import."""


def test_the_job_runtime_never_imports_the_cluster_or_the_command_line():
    wrong = [
        f"{m} imports {dep}"
        for m, deps in _graph().items()
        for low, above in FLOORS_WITHIN.items()
        if m == low or m.startswith(low + ".")
        for dep in sorted(deps)
        if any(dep == a or dep.startswith(a + ".") for a in above)
    ]
    assert not wrong, "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if dep == m.rpartition(".")[0] or m == dep.rpartition(".")[0]:
                continue  # a package and its own submodule (the __init__ re-exporting it)
            if color.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in color and (found := visit(dep)):
                return found
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if m not in color and (found := visit(m)):
            return found
    return None


def test_no_import_cycles_between_files():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]
    assert _cycle({"a.x": {"a.y"}, "a.y": set()}) is None


@pytest.mark.parametrize("pkg", PACKAGES)
def test_long_modules_say_why(pkg):
    long = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(LONG_MARK in line for line in itertools.islice(lines, 30)):
            long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not long, f"over {MAX_LINES} lines without a '{LONG_MARK}' reason near the top:\n" + "\n".join(
        long
    )


def test_each_package_says_what_it_owns_and_what_it_may_import():
    """Every package's __init__ docstring ends its first paragraph on what it owns and has a `May import:`
    line naming exactly the packages ALLOWED lets it import (or "nothing" / "every other package")."""
    for pkg in PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text())) or ""
        assert doc, f"{pkg}/__init__.py has no docstring saying what the package owns"
        line = next((ln for ln in doc.splitlines() if ln.startswith("May import:")), None)
        assert line is not None, f"{pkg}/__init__.py: no 'May import:' line"
        named = {p for p in PACKAGES if re.search(rf"\b{p}\b", line)}
        if "every other package" in line:
            named = set(PACKAGES) - {pkg}
        assert named == ALLOWED[pkg], (
            f"{pkg}: docstring says {sorted(named)}, the rule {sorted(ALLOWED[pkg])}"
        )


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80
"""A class or function longer than this says why in a `# Long: <reason>` comment right above it."""


def _long_without_reason(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines), str(path))):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= limit:
            continue
        above = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 2  # 0-based line above
        comments = []
        while above >= 0 and lines[above].strip().startswith("#"):
            comments.append(lines[above])
            above -= 1
        if not any("# Long:" in c for c in comments):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return out


def test_long_classes_and_functions_say_why():
    wrong = [
        w for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) for w in _long_without_reason(p)
    ]
    assert not wrong, (
        f"classes over {MAX_CLASS_LINES} or functions over {MAX_FUNCTION_LINES} lines without a '# Long:' "
        "reason right above them:\n" + "\n".join(wrong)
    )


TESTS = ROOT / "tests"
TIERS = ("unit", "integration", "system")
TEST_AREAS = set(PACKAGES) | {"benchmarks", "deploy", "multinode"}
"""What a tier's folders mirror: the packages, the benchmarks, the deployment files, several nodes."""


def test_the_test_tree_is_tiers_mirroring_the_packages_and_one_harness():
    """Every test file sits in tests/<tier>/<package or area>/ (the folder says the tier: tests/conftest.py
    marks tests/system/ `slow`), basenames are unique (pytest imports them by name), helper modules live
    in tests/harness/ only, and no test marks itself slow."""
    misplaced, helpers, self_marked = [], [], []
    names: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if rel.parts[0] == "harness" or rel == Path("conftest.py"):
            continue
        if not path.name.startswith("test_"):
            helpers.append(str(rel))
            continue
        names.setdefault(path.name, []).append(str(rel))
        tier_ok = rel.parts[0] in TIERS and (rel.parts[1] in TEST_AREAS if len(rel.parts) == 3 else False)
        if not tier_ok and rel != Path("unit/test_structure.py"):
            misplaced.append(str(rel))
        if re.search(r"pytest\.mark\.slow\b", path.read_text()):
            self_marked.append(str(rel))
    assert not misplaced, f"test files outside tests/<tier>/<package>/ ({TIERS}): {misplaced}"
    assert not helpers, f"helper modules belong in tests/harness/: {helpers}"
    assert not self_marked, f"the folder says the tier; these mark themselves slow: {self_marked}"
    assert not {n: p for n, p in names.items() if len(p) > 1}, "test file names must be unique"
