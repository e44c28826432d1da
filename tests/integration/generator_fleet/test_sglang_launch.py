"""Real SGLang servers and external engines: a launched server's life (health, registry lease, /generate,
stop, a failed start), attaching to engines someone else runs, and an sglang-router in front of them.

Without SGLang, `python -m sglang.launch_server` runs tests/harness/sglang_shim.py (SGLang's flag
names, types and choices; serves the built-in engine); with SGLang installed the same tests launch the real
server.
"""

from __future__ import annotations

import asyncio
import json
import os

import http_calls
import pytest
from fake_router import FakeRouter
from registry_helpers import live
from sglang_env import REAL_SGLANG_ENV, SGLANG_INSTALLED, install_shim

from common.net import free_port
from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.launch import (
    EngineStartError,
    ExternalEngines,
    HealthCheckedRegistration,
    SGLangServer,
    is_healthy,
    router_add_worker,
    router_remove_worker,
    router_workers,
)
from jobspec import SGLangSpec
from weight_bus.registry import engines_key

KEY = "launch-key"
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def generate(url: str, prompt: list[int]):
    async def go():
        async with EngineClient(url, api_key=KEY) as client:
            return await client.generate(prompt, GREEDY)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def launch_env(tmp_path_factory) -> dict[str, str]:
    """The environment that launches SGLang: the real one when installed, else the shim."""
    return dict(REAL_SGLANG_ENV) if SGLANG_INSTALLED else install_shim(tmp_path_factory.mktemp("shim"))


# ---- a launched server ----------------------------------------------------------------------------


def test_launched_server_serves_registers_and_stops(
    tmp_path, tiny_model_dir, launch_env, redis_server, job_id
):
    sg = SGLangSpec(
        dtype="float32",
        mem_fraction_static=0.5,
        context_length=256,
        served_model_name="tiny",
        skip_server_warmup=True,
        startup_timeout_s=120,
    )
    server = SGLangServer(
        str(tiny_model_dir), sg, tmp_path / "logs" / "sglang-0.log", api_key=KEY, env=launch_env
    )
    server.start()
    client = redis_server.client()
    try:
        reg = HealthCheckedRegistration(client, job_id, server.url, api_key=KEY, alive=server.alive)
        assert live(redis_server, job_id) == [server.url]
        res = generate(server.url, [1, 5, 6])
        assert len(res.output_ids) == 4 and res.finish_reason == "length"
        assert res.weight_version == "0" and res.token_versions == [0] * 4  # --weight-version 0
        info = http_calls.get(
            f"{server.url}/get_server_info", headers={"Authorization": f"Bearer {KEY}"}
        ).json()
        assert info["served_model_name"] == "tiny" and info["context_length"] == 256
        log_text = server.log_path.read_text()
        assert "--api-key ***" in log_text.splitlines()[0] and KEY not in log_text.splitlines()[0]
        if not SGLANG_INSTALLED:  # what the shim parsed: a flag sent under a wrong name or type shows here
            line = next(x for x in log_text.splitlines() if x.startswith("SHIM_ARGS "))
            assert json.loads(line.removeprefix("SHIM_ARGS ")) == {
                "model_path": str(tiny_model_dir),
                "host": "127.0.0.1",
                "port": server.port,
                "api_key": KEY,
                "dtype": "float32",
                "tp_size": 1,
                "mem_fraction_static": 0.5,
                "context_length": 256,
                "served_model_name": "tiny",
                "weight_version": "0",
                "skip_server_warmup": True,
                "enable_metrics": True,
                "enable_memory_saver": False,
                "enable_weights_cpu_backup": False,
                "enable_fp32_lm_head": False,
                "enable_lora": False,
                "max_lora_rank": None,
                "lora_target_modules": None,
                "max_loras_per_batch": 8,
                "lora_paths": None,
            }

        pgid = server.proc.pid
        server.stop()
        assert server.proc.returncode is not None and not is_healthy(server.url)
        with pytest.raises(ProcessLookupError):  # nothing of its process group is left
            os.killpg(pgid, 0)
        # A dead engine's lease is not renewed: once it runs out, rollout workers stop routing to it.
        client.zadd(engines_key(job_id), {server.url: 0})
        reg.renew()
        assert live(redis_server, job_id) == []
        reg.close()
    finally:
        server.stop()
        client.close()


def test_failed_launch_reports_the_log_tail(tmp_path, tiny_model_dir, launch_env):
    sg = SGLangSpec(extra_args=["--no-such-flag"], startup_timeout_s=120)
    server = SGLangServer(str(tiny_model_dir), sg, tmp_path / "sglang.log", env=launch_env)
    with pytest.raises(EngineStartError) as exc:
        server.start()
    msg = str(exc.value)
    assert "exited with code 2" in msg and "unrecognized arguments: --no-such-flag" in msg
    assert str(tmp_path / "sglang.log") in msg


# ---- external engines and a router ----------------------------------------------------------------


@pytest.fixture(scope="module")
def external(tiny_model_dir):
    """An engine 'someone else runs'."""
    server = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def test_attach_registers_healthy_external_engines(external, redis_server, job_id):
    client = redis_server.client()
    engines = ExternalEngines([external.url + "/"], api_key=KEY)
    try:
        assert engines.attach(client, job_id) == [external.url]
        assert live(redis_server, job_id) == [external.url]
        res = generate(live(redis_server, job_id)[0], [1, 5, 6])
        assert len(res.output_ids) == 4 and res.token_versions == [0] * 4
        engines.detach()
        assert live(redis_server, job_id) == []

        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(EngineStartError, match=f"external engine {dead} is not healthy"):
            ExternalEngines([external.url, dead], api_key=KEY, timeout_s=1.0).attach(client, job_id)
        assert live(redis_server, job_id) == []  # nothing registered when one engine is missing
    finally:
        engines.detach()
        client.close()


def test_router_in_front_takes_requests_while_workers_stay_reachable(external, redis_server, job_id):
    router = FakeRouter()
    client = redis_server.client()
    engines = ExternalEngines([], router_url=router.url + "/", api_key=KEY)
    try:
        router_add_worker(router.url, external.url, KEY)
        # No urls: the workers come from the router; the registry holds the router, where requests go.
        assert engines.attach(client, job_id) == [external.url]
        assert live(redis_server, job_id) == [router.url]
        res = generate(router.url, [1, 5, 6])
        assert len(res.output_ids) == 4 and router.versions == ["0"]

        async def mixed_batch():  # resumed samples ask for fewer tokens: one request per params set
            async with EngineClient(router.url, api_key=KEY) as client:
                params = [GREEDY, {**GREEDY, "max_new_tokens": 2}, GREEDY]
                return await client.generate_batch([[1, 5], [1, 6], [1, 7]], params, rid="g7")

        router.requests, router.versions = 0, []
        assert [len(r.output_ids) for r in asyncio.run(mixed_batch())] == [4, 2, 4]
        assert router.requests == 2 and router.versions == ["0"] * 3
        # Control calls (here a version bump) go to the worker itself; the router's traffic shows them.
        http_calls.post(
            f"{external.url}/update_weight_version",
            json={"new_version": "3"},
            headers={"Authorization": f"Bearer {KEY}"},
        ).raise_for_status()
        assert generate(router.url, [1, 5, 6]).weight_version == "3" and router.versions[-1] == "3"
        router_remove_worker(router.url, external.url, KEY)
        assert router_workers(router.url, KEY) == []
    finally:
        http_calls.post(
            f"{external.url}/update_weight_version",
            json={"new_version": "0"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        engines.detach()
        client.close()
        router.stop()
