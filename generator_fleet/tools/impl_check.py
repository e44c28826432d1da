"""Checks a job's `tools[].impl` without running any of it: the control API and `slipstream run/validate` call
this before a job starts, so a typo or a non-tool (`os:system`) fails at submit, naming its key, instead of
being imported and called in every rollout worker.

The module's source is located on `sys.path` (no import, not even of its parent packages) and parsed with
`ast`; the class must be defined there (or reached through `from ... import` / base classes in sources
found the same way) and have the Tool protocol's members: `name`, `schema()` and `async call()`.

Tasks and rewards named by import path (`dataset.name`, `reward.name`) are checked the same way by
`check_callable`, which only asks for a top-level definition of the name.

The operator's allow-list (`slipstream cluster up --tool-modules` / `--builtin-tools-only`) is enforced here
at submit and again where the rollout workers import them (`$SLIPSTREAM_TOOL_MODULES`): custom tools, tasks
and rewards alike.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

TOOL_MODULES_ENV = "SLIPSTREAM_TOOL_MODULES"
"""JSON list of the modules (with their submodules) custom tools may come from; [] = builtin tools only;
unset = any module. The control API sets it on the jobs it submits."""
BUILTIN_TOOL_NAMES = ("calculator", "python", "check_answer")
"""generator_fleet.tools.BUILTIN_TOOLS's keys (kept here so the check imports no tool)."""
_MAX_DEPTH = 8


def allowed_from_env() -> list[str] | None:
    raw = os.environ.get(TOOL_MODULES_ENV)
    if raw is None:
        return None
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise ValueError(f"${TOOL_MODULES_ENV} must be a JSON list of module names, got {raw!r}")
    return value


def module_allowed(module: str, allowed: Sequence[str] | None) -> bool:
    return allowed is None or any(module == m or module.startswith(m + ".") for m in allowed)


def not_allowed(module: str, allowed: Sequence[str]) -> str:
    where = f"builtin tools and the modules {', '.join(allowed)}" if allowed else "builtin tools only"
    return (
        f"module {module!r} is not allowed on this cluster ({where}; the operator sets this with "
        "`slipstream cluster up --tool-modules` or `--builtin-tools-only`)"
    )


def import_path(what: str, target: str) -> Any:
    """The object at `target` (`package.module:attr[.attr]`), imported; a ValueError that starts with
    `what` (e.g. "tool 'calc'") when the module or the attribute is missing."""
    import importlib

    module_name, _, attr_path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"{what}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def check_tools(
    tools: Iterable[Any], allowed: Sequence[str] | None = None, path: Sequence[str] | None = None
) -> str | None:
    """The first problem of a job spec's tool list as "message - at `$.tools[i].key`", else None.
    `tools`: entries with `name` and `impl`; `allowed`: the operator's module allow-list (None: any);
    `path`: where modules are looked for (default sys.path)."""
    for i, tool in enumerate(tools):
        if tool.impl is None:
            if tool.name not in BUILTIN_TOOL_NAMES:
                return (
                    f"tool {tool.name!r}: no builtin tool of that name (builtins: {sorted(BUILTIN_TOOL_NAMES)}); "
                    f"set impl: 'package.module:ClassName' for a custom tool - at `$.tools[{i}].name`"
                )
            continue
        if why := check_impl(tool.impl, allowed, path):
            return f"tool {tool.name!r}: {why} - at `$.tools[{i}].impl`"
    return None


def check_impl(
    impl: str, allowed: Sequence[str] | None = None, path: Sequence[str] | None = None
) -> str | None:
    """Why `impl` ("package.module:ClassName") cannot be a tool class, else None. Runs none of its code."""
    module, sep, attr = impl.partition(":")
    if (
        not sep
        or not module
        or not attr
        or not all(p.isidentifier() for p in module.split(".") + attr.split("."))
    ):
        return f"impl {impl!r} is not of the form 'package.module:ClassName'"
    if not module_allowed(module, allowed):
        return not_allowed(module, allowed or [])
    finder = _Finder(list(sys.path if path is None else path))
    source = finder.source(module)
    if source is None:
        return f"cannot find the Python source of module {module!r} on the cluster's path"
    found = finder.cls(module, attr.split("."), 0)
    if isinstance(found, str):
        return found
    members, unread = finder.members(module, found, 0)
    missing = [m for m in ("name", "schema", "call") if m not in members]
    if missing:
        also = f" (its base classes {', '.join(unread)} could not be read)" if unread else ""
        return (
            f"{impl} does not satisfy the Tool protocol (needs name, schema(), async call()): "
            f"no {', '.join(missing)}{also}"
        )
    if members["call"] != "async":
        return f"{impl}: call() must be an async method"
    return None


def check_callable(
    impl: str, allowed: Sequence[str] | None = None, path: Sequence[str] | None = None
) -> str | None:
    """Why `impl` ("package.module:attr", a custom task or reward) cannot be imported, else None: the form,
    the allow-list, the module's source and a top-level definition (or `from ... import`) of the
    attribute's first part. Runs none of its code."""
    module, sep, attr = impl.partition(":")
    if not sep or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        return f"{impl!r} is not of the form 'package.module:attr'"
    if not module_allowed(module, allowed):
        return not_allowed(module, allowed or [])
    finder = _Finder(list(sys.path if path is None else path))
    if finder.source(module) is None:
        return f"cannot find the Python source of module {module!r} on the cluster's path"
    tree = finder.tree(module)
    if tree is None:
        return f"cannot read the Python source of module {module!r}"
    head = attr.split(".")[0]
    if _defined(tree.body, head) is None and _imported(tree, module, head, finder) is None:
        return f"module {module!r} defines no {head!r}"
    return None


class _Finder:
    """Module sources on a search path, read and parsed once each."""

    def __init__(self, path: list[str]) -> None:
        self.path = [p or "." for p in path]
        self.trees: dict[str, ast.Module | None] = {}

    def source(self, module: str) -> Path | None:
        parts = module.split(".")
        for entry in self.path:
            base = Path(entry).joinpath(*parts[:-1])
            for candidate in (base / parts[-1] / "__init__.py", base / f"{parts[-1]}.py"):
                if candidate.is_file():
                    return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            src = self.source(module)
            try:
                self.trees[module] = ast.parse(src.read_bytes(), str(src)) if src else None
            except (SyntaxError, ValueError, OSError):
                self.trees[module] = None
        return self.trees[module]

    def cls(self, module: str, attrs: list[str], depth: int) -> tuple[str, ast.ClassDef] | str:
        """(module, class node) of `attrs` in `module`, following `from x import Name`; else why not."""
        tree = self.tree(module)
        if tree is None:
            return f"cannot read the Python source of module {module!r}"
        body: list[ast.stmt] = tree.body
        for i, attr in enumerate(attrs):
            node = _defined(body, attr)
            if node is None and i == 0 and depth < _MAX_DEPTH:
                origin = _imported(tree, module, attr, self)
                if origin is not None:
                    return self.cls(origin[0], [origin[1], *attrs[1:]], depth + 1)
            if not isinstance(node, ast.ClassDef):
                return f"{'.'.join(attrs[: i + 1])} is not a class defined in module {module!r}"
            body = node.body
        return module, node

    def members(
        self, module: str, found: tuple[str, ast.ClassDef], depth: int
    ) -> tuple[dict[str, str], list[str]]:
        """{member: "async" | "def" | "attr"} of a class and its readable bases; the unreadable bases."""
        node = found[1]
        members: dict[str, str] = {}
        unread: list[str] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in ("object", "Protocol", "Generic"):
                continue
            ref = _dotted(base)
            resolved = self.cls(found[0], ref.split("."), 0) if ref and depth < _MAX_DEPTH else None
            if isinstance(resolved, tuple):
                inherited, more = self.members(resolved[0], resolved, depth + 1)
                members.update(inherited)
                unread += more
            else:
                unread.append(ast.unparse(base))
        for stmt in node.body:
            if isinstance(stmt, ast.AsyncFunctionDef):
                members[stmt.name] = "async"
            elif isinstance(stmt, ast.FunctionDef):
                members[stmt.name] = "def"
                for sub in ast.walk(stmt):  # self.name = ... in a method
                    for target in _targets(sub):
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            members.setdefault(target.attr, "attr")
            else:
                for target in _targets(stmt):
                    if isinstance(target, ast.Name):
                        members[target.id] = "attr"
        return members, unread


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _defined(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last top-level statement of `body` that binds `name` (a class, a function or an assignment)."""
    found = None
    for stmt in body:
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            found = stmt
        elif any(isinstance(t, ast.Name) and t.id == name for t in _targets(stmt)):
            found = stmt
    return found


def _imported(tree: ast.Module, module: str, name: str, finder: _Finder) -> tuple[str, str] | None:
    """(module, name) that `from module import name [as alias]` at the top of `tree` binds to `name`."""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    if stmt.level:
                        is_pkg = (finder.source(module) or Path()).name == "__init__.py"
                        parent = module.split(".")
                        parent = parent if is_pkg else parent[:-1]
                        parent = parent[: len(parent) - (stmt.level - 1)] if stmt.level > 1 else parent
                        origin = ".".join([*parent, *([stmt.module] if stmt.module else [])])
                    else:
                        origin = stmt.module or ""
                    return (origin, alias.name) if origin else None
    return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)):
        return f"{head}.{node.attr}"
    return None
