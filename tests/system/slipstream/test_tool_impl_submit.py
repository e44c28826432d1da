"""`tools[].impl` is checked at submit by the control API of a real cluster, started with an operator
allow-list of tool modules: bad or disallowed impls are refused without running any of them, and an allowed
tool class is accepted, its Ray job carrying the allow-list to the rollout workers."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import http_calls
import httpx
import pytest
from cluster_helpers import paced_engines
from tool_allow_list import ALLOWED

from generator_fleet.tools.impl_check import TOOL_MODULES_ENV
from slipstream.cluster import services as cluster
from slipstream.cluster.state import ray_env


@pytest.fixture(scope="module")
def info():
    home = Path(tempfile.mkdtemp(prefix="sstool-", dir="/tmp"))
    with paced_engines():
        info = cluster.up(home, start_prometheus=False, tool_modules=ALLOWED)
    try:
        yield info
    finally:
        cluster.down(home)


def _submit(info, text: str, cwd: Path) -> httpx.Response:
    return http_calls.post(
        f"{info.api_url}/jobs",
        headers={"Authorization": f"Bearer {info.api_token}"},
        json={"spec": text, "cwd": str(cwd)},
        timeout=60,
    )


def test_the_control_api_refuses_bad_or_disallowed_impls_at_submit(
    info, tmp_path, tiny_model_dir, monkeypatch
):
    marker = tmp_path / "ran"
    head = f"model: {{path: {tiny_model_dir}}}\nalgorithm: {{total_steps: 100000}}\n"
    refused = {
        # would run `touch` as the server's user in every rollout worker if it were imported and called
        f"name: sys\nagent: {{}}\ntools: [{{name: t, impl: 'os:system', args: {{command: 'touch {marker}'}}}}]\n": (
            "module 'os' is not allowed on this cluster (builtin tools and the modules "
            "generator_fleet.tools.examples; the operator sets this with `slipstream cluster up --tool-modules`"
        ),
        "name: nope\nagent: {}\ntools: [{name: t, impl: 'generator_fleet.tools.examples:Nope'}]\n": (
            "Nope is not a class defined in module 'generator_fleet.tools.examples' - at `$.tools[0].impl`"
        ),
        "name: noagent\ntools: [{name: echo, impl: 'generator_fleet.tools.examples:EchoTool'}]\n": (
            "set `agent:` too - at `$.tools`"
        ),
    }
    for text, message in refused.items():
        r = _submit(info, head + text, tmp_path)
        assert r.status_code == 422, r.text
        assert message in r.json()["detail"], r.json()
    jobs = http_calls.get(
        f"{info.api_url}/jobs", headers={"Authorization": f"Bearer {info.api_token}"}, timeout=30
    ).json()
    assert jobs == [] and not marker.exists()

    # An allowed tool class is accepted, and its Ray job carries the allow-list to the rollout workers.
    text = (
        head
        + "name: echo\nagent: {}\ntools: [{name: echo, impl: 'generator_fleet.tools.examples:EchoTool'}]\n"
    )
    r = _submit(info, text, tmp_path)
    assert r.status_code == 201, r.text
    for k, v in ray_env(info).items():  # for this test only: later tests start Ray instances of their own
        monkeypatch.setenv(k, v)
    from ray.job_submission import JobSubmissionClient

    ray = JobSubmissionClient(info.dashboard_url, headers={"Authorization": f"Bearer {info.ray_auth_token}"})
    try:
        env = ray.get_job_info(r.json()["ray_job_id"]).runtime_env["env_vars"]
        assert json.loads(env[TOOL_MODULES_ENV]) == ALLOWED
    finally:
        http_calls.post(
            f"{info.api_url}/jobs/echo/stop",
            headers={"Authorization": f"Bearer {info.api_token}"},
            json={"force": True},
            timeout=60,
        )
