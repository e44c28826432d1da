"""Which SGLang the generator-fleet tests launch: the real one when it is installed (or
SLIPSTREAM_SGLANG_PYTHON names an interpreter that has it), else sglang_shim.py installed as a package
named `sglang` in a temporary directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("sglang_shim.py")
SGLANG_INSTALLED = (
    importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("sgl_kernel") is not None
) or bool(os.environ.get("SLIPSTREAM_SGLANG_PYTHON"))
"""SGLang's server can run here: the package with its kernels (the frontend alone, `sglang.lang`, does not
launch a server)."""
REAL_SGLANG_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
"""The tiny test models say 64 positions; SGLang refuses a longer --context-length without this."""


def install_shim(root: Path) -> dict[str, str]:
    """Make `python -m sglang.launch_server` run the shim; returns the environment that does it."""
    pkg = root / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    shutil.copy(SHIM, pkg / "launch_server.py")
    path = [str(root), str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
