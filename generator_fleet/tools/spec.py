"""The job-spec entry that names one tool: a builtin by name, or any class by import path."""

from __future__ import annotations

from typing import Any

import msgspec


class ToolSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One tool offered to the model.

    Builtin:  ``{name: calculator}`` or ``{name: python, args: {timeout_s: 2.0}}``.
    Custom:   ``{name: echo, impl: "generator_fleet.tools.examples:EchoTool", args: {prefix: ">> "}}``.
    """

    name: str
    """The name the model calls the tool by (must equal the constructed tool's ``name``); a builtin
    (``calculator``, ``python``, ``check_answer``) unless ``impl`` is set."""
    impl: str | None = None
    """``"package.module:ClassName"`` to import and construct (see generator_fleet/tools/examples.py);
    None means the builtin called ``name``."""
    args: dict[str, Any] = {}
    """Keyword arguments for the tool's constructor (e.g. python: ``{timeout_s: 5, memory_mb: 256}``)."""
