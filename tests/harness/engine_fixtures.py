"""Engine kinds for the contract suite (test_engine.py): the built-in engine always, and a real SGLang
server launched by the fleet's own launcher when SGLang is there. Tests that check built-in-only details
(its internal_states fields, its own metrics, its version string) carry `@pytest.mark.builtin_only`.

Environment:
- SLIPSTREAM_SGLANG: `auto` (default: add the `sglang` kind when `import sglang` works or
  SLIPSTREAM_SGLANG_PYTHON is set), `0` (never), `shim` (the `sglang` kind runs tests/harness/
  sglang_shim.py, i.e. the built-in engine behind the SGLang launcher: checks this plumbing on CPU).
- SLIPSTREAM_SGLANG_PYTHON: an interpreter that has sglang (SGLang in its own venv or image).
- SLIPSTREAM_SGLANG_ARGS: extra launch_server flags, e.g. "--attention-backend triton".
"""

from __future__ import annotations

import os
import shlex

import pytest
from sglang_env import REAL_SGLANG_ENV, SGLANG_INSTALLED, install_shim

from jobspec import SGLangSpec

_MODE = os.environ.get("SLIPSTREAM_SGLANG", "auto")
ENGINE_KINDS = ["builtin"] + (["sglang"] if _MODE == "shim" or (_MODE == "auto" and SGLANG_INSTALLED) else [])


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "builtin_only: checks a detail of the built-in engine, not the contract"
    )


def pytest_collection_modifyitems(config, items) -> None:
    skip = pytest.mark.skip(reason="checks a built-in engine detail, not SGLang's contract")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("engine_kind") == "sglang" and item.get_closest_marker("builtin_only"):
            item.add_marker(skip)


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine_kind(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def start_engine(tmp_path_factory):
    """start_engine(kind, model_path, api_key, context_length) -> a started server with `.url`, `.stop()`."""
    from generator_fleet.engine import EngineServer
    from generator_fleet.launch import SGLangServer

    def start(kind: str, model_path, api_key: str, context_length: int):
        if kind == "builtin":
            return EngineServer(str(model_path), api_key=api_key, context_length=context_length).start()
        root = tmp_path_factory.mktemp("sglang")
        env = dict(REAL_SGLANG_ENV)
        if _MODE == "shim":
            env.update(install_shim(root / "shim"))
        sg = SGLangSpec(
            python=os.environ.get("SLIPSTREAM_SGLANG_PYTHON"),
            dtype="float32",  # the suite compares logprobs with an fp32 reference to 1e-3
            context_length=context_length,
            extra_args=shlex.split(os.environ.get("SLIPSTREAM_SGLANG_ARGS", "")),
        )
        return SGLangServer(str(model_path), sg, root / "sglang.log", api_key=api_key, env=env).start()

    return start
