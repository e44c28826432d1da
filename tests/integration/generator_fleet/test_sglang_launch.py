"""Real SGLang servers and external engines: the launch command against SGLang's flags, a launched server's
life (health, registry lease, /generate, stop, a failed start), attaching to engines someone else runs, and
an sglang-router in front of them.

Without SGLang, `python -m sglang.launch_server` runs tests/harness/sglang_shim.py (SGLang's flag
names, types and choices; serves the built-in engine); with SGLang installed the same tests launch the real
server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from registry_helpers import live
from sglang_env import REAL_SGLANG_ENV, SGLANG_INSTALLED, install_shim
from sglang_shim import parse as shim_parse

from common.net import free_port
from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.launch import (
    EngineStartError,
    ExternalEngines,
    HealthCheckedRegistration,
    SGLangServer,
    is_healthy,
    redact,
    router_add_worker,
    router_remove_worker,
    router_workers,
    sglang_command,
)
from jobspec import SGLangSpec
from models.config import LoraSpec
from weight_bus.registry import engines_key

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray

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


# ---- the command line -----------------------------------------------------------------------------


def test_command_uses_sglang_flag_names_and_parses_as_sglang_would():
    sg = SGLangSpec(
        python="/opt/sglang/bin/python",
        dtype="bfloat16",
        tp_size=2,
        mem_fraction_static=0.7,
        context_length=8192,
        served_model_name="policy",
        skip_server_warmup=True,
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        enable_fp32_lm_head=True,
        extra_args=["--attention-backend", "triton"],
    )
    cmd = sglang_command("/models/qwen", 31000, sg, api_key="s3cret")
    assert cmd == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--weight-version",
        "0",
        "--api-key",
        "s3cret",
        "--mem-fraction-static",
        "0.7",
        "--context-length",
        "8192",
        "--served-model-name",
        "policy",
        "--skip-server-warmup",
        "--enable-metrics",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-fp32-lm-head",
        "--attention-backend",
        "triton",
    ]
    # A colocated engine's flags parse under SGLang's names (the shim's copy of its parser).
    colocated = SGLangSpec(mem_fraction_static=0.5, enable_memory_saver=True, enable_weights_cpu_backup=True)
    args = shim_parse(sglang_command("/m", 30000, colocated)[3:])
    assert shim_parse(
        sglang_command("/m", 30000, SGLangSpec(enable_fp32_lm_head=True))[3:]
    ).enable_fp32_lm_head
    assert (args.mem_fraction_static, args.enable_memory_saver, args.enable_weights_cpu_backup) == (
        0.5,
        True,
        True,
    )
    assert "s3cret" not in redact(cmd) and redact(cmd)[redact(cmd).index("--api-key") + 1] == "***"
    # Options left null are left to SGLang; defaults give a command SGLang's parser accepts as meant.
    minimal = sglang_command("/m", 30000, SGLangSpec())
    assert "--api-key" not in minimal and "--context-length" not in minimal
    args = shim_parse(minimal[3:])
    assert (args.model_path, args.port, args.dtype, args.tp_size, args.weight_version) == (
        "/m",
        30000,
        "auto",
        1,
        "0",
    )
    assert args.enable_metrics and not args.skip_server_warmup and args.mem_fraction_static is None
    assert (
        not args.enable_memory_saver and not args.enable_weights_cpu_backup and not args.enable_fp32_lm_head
    )
    with pytest.raises(SystemExit):  # the shim rejects unknown flags, as SGLang's argparse does
        shim_parse([*minimal[3:], "--no-such-flag"])


def _sglang_lora_args_text() -> str:
    """The source of SGLang's ServerArgs fields (server_args.py, or its `lora` field namespace in newer
    versions); skips the test where SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("SGLang is not installed: its server_args cannot be checked")
    srt = Path(spec.origin).parent / "srt"
    return "".join(
        f.read_text()
        for f in (srt / "server_args.py", srt / "arg_groups" / "fields" / "lora.py")
        if f.exists()
    )


def test_lora_job_command_enables_lora_with_sglang_flags():
    lora = LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "v_proj", "down_proj"])
    cmd = sglang_command("/m", 30000, SGLangSpec(), lora=lora)
    i = cmd.index("--enable-lora")
    assert cmd[i:] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "down_proj",
        "--max-loras-per-batch",
        "2",
    ]
    args = shim_parse(cmd[3:])
    assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch) == (
        True,
        16,
        ["q_proj", "v_proj", "down_proj"],
        2,
    )
    assert "--enable-lora" not in sglang_command("/m", 30000, SGLangSpec())
    # the flags are SGLang's own: its ServerArgs fields (server_args.py, or its `lora` field namespace
    # in newer versions) where SGLang is installed
    text = _sglang_lora_args_text()
    for name in ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch"):
        assert re.search(rf"^\s+{name}\s*:", text, re.M), name


def test_lora_job_starts_sglang_with_its_untrained_adapter(tmp_path, tiny_model_dir):
    """A LoRA job's version 0 on SGLang: a zero PEFT directory loaded at start (--lora-paths NAME=PATH);
    an engine that loads it answers as the base model under the adapter's name."""
    from generator_fleet.launch import write_untrained_adapter

    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "down_proj"], name="pol")
    path = write_untrained_adapter(str(tiny_model_dir), lora, tmp_path / "untrained")
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 4
    cmd = sglang_command("/m", 30000, SGLangSpec(), lora=lora, initial_adapter=str(path))
    assert cmd[-2:] == ["--lora-paths", f"pol={path}"]
    assert shim_parse(cmd[3:]).lora_paths == [f"pol={path}"]
    server = EngineServer(str(tiny_model_dir), torch_threads=1, lora=lora).start()
    try:
        server.runner.load_lora_from_dir("pol", str(path))
        body = {"input_ids": [1, 5, 6, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        base = httpx.post(server.url + "/generate", json=body, timeout=60).json()["output_ids"]
        on_adapter = httpx.post(
            server.url + "/generate", json={**body, "lora_path": "pol"}, timeout=60
        ).json()
        assert on_adapter["output_ids"] == base
    finally:
        server.stop()
    text = _sglang_lora_args_text()
    assert re.search(r"^\s+lora_paths\s*:", text, re.M)


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
        info = httpx.get(f"{server.url}/get_server_info", headers={"Authorization": f"Bearer {KEY}"}).json()
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


class FakeRouter:
    """The sglang-router API the fleet uses (sgl-router's server.rs): /health, /list_workers -> {"urls"},
    POST /add_worker?url=&api_key=, POST /remove_worker?url=, and /generate proxied to a worker with that
    worker's key. Served by uvicorn in a thread; records the weight versions of what it proxied."""

    def __init__(self) -> None:
        self.workers: dict[str, str | None] = {}
        self.added: list[str] = []
        self.versions: list[str] = []
        self.requests = 0
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/list_workers")
        async def list_workers() -> dict:
            return {"urls": list(self.workers)}

        @app.post("/add_worker")
        async def add_worker(url: str, api_key: str | None = None) -> Response:
            self.workers[url] = api_key
            self.added.append(url)
            return Response(f"Successfully added worker: {url}")

        @app.post("/remove_worker")
        async def remove_worker(url: str) -> Response:
            del self.workers[url]
            return Response(f"Successfully removed worker: {url}")

        @app.post("/generate")
        async def proxy(request: Request) -> Response:
            body = await request.body()
            req = json.loads(body)
            # sgl-router's GenerateRequest: one `sampling_params` object, one `rid` string (axum: 422).
            if isinstance(req.get("sampling_params"), list) or not isinstance(req.get("rid", ""), str):
                return Response("Failed to deserialize the JSON body into the target type", status_code=422)
            self.requests += 1
            url, key = next(iter(self.workers.items()))
            async with httpx.AsyncClient(timeout=60) as http:
                resp = await http.post(
                    url + "/generate",
                    content=body,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
            out = resp.json()
            self.versions += [
                o["meta_info"]["weight_version"] for o in (out if isinstance(out, list) else [out])
            ]
            return Response(resp.content, status_code=resp.status_code, media_type="application/json")

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not is_healthy(self.url):
            assert time.monotonic() < deadline, "fake router did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


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
        httpx.post(
            f"{external.url}/update_weight_version",
            json={"new_version": "3"},
            headers={"Authorization": f"Bearer {KEY}"},
        ).raise_for_status()
        assert generate(router.url, [1, 5, 6]).weight_version == "3" and router.versions[-1] == "3"
        router_remove_worker(router.url, external.url, KEY)
        assert router_workers(router.url, KEY) == []
    finally:
        httpx.post(
            f"{external.url}/update_weight_version",
            json={"new_version": "0"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        engines.detach()
        client.close()
        router.stop()


def test_job_with_sglang_engines_behind_a_router(tmp_path, tiny_model_dir):
    """`slipstream run` with engine: sglang and a router: the fleet launches the server (here the shim,
    through `sglang.python`, as for SGLang in its own venv), adds it to the router, sends rollouts through
    the router and weight updates straight to the engine, and stops it at the end."""
    import jobspec
    from slipstream.job.local import run_job

    python = tmp_path / "python-with-sglang"
    env = install_shim(tmp_path / "shim")
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    router = FakeRouter()
    try:
        spec = jobspec.from_dict(
            {
                "name": "sglang-e2e",
                "output_dir": str(tmp_path / "run"),
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
                "generators": {
                    "engine": "sglang",
                    "router_url": router.url,
                    "sglang": {"python": str(python), "gpus_per_engine": 0, "skip_server_warmup": True},
                },
                "algorithm": {"groups_per_step": 2, "total_steps": 2},
                "buffer": {"max_staleness": 0},
            }
        )
        result = run_job(spec)
    finally:
        router.stop()
    assert result.version == 2
    [engine_url] = router.added
    assert router.workers == {}  # removed when the job ended
    # On-policy: step 2 trained on groups generated at version 1, which only a weight update sent to the
    # engine itself (the router forwards none) can have produced; they came back through the router.
    assert "0" in router.versions and "1" in router.versions
    log_text = (tmp_path / "run" / "logs" / "sglang-0.log").read_text()
    assert "SHIM_ARGS" in log_text and "--api-key ***" in log_text
    assert not is_healthy(engine_url)  # stopped with the job


def test_lora_job_on_sglang_engines_serves_its_adapter_from_the_start(tmp_path, tiny_model_dir):
    """A LoRA job with engine: sglang (the shim, through `sglang.python`): the server starts with the zero
    adapter (--lora-paths), rollouts name it from the first request, and the job's publishes replace it."""
    import jobspec
    from slipstream.job.local import run_job

    python = tmp_path / "python-with-sglang"
    env = install_shim(tmp_path / "shim")
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    spec = jobspec.from_dict(
        {
            "name": "sglang-lora",
            "output_dir": str(tmp_path / "run"),
            "model": {
                "path": str(tiny_model_dir),
                "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
            },
            "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
            "generators": {
                "engine": "sglang",
                "sglang": {"python": str(python), "gpus_per_engine": 0, "skip_server_warmup": True},
            },
            "algorithm": {"groups_per_step": 2, "total_steps": 2},
            "buffer": {"max_staleness": 0},
            "bus": {"pause_mode": "abort"},
        }
    )
    result = run_job(spec)
    assert result.version == 2
    untrained = tmp_path / "run" / "lora" / "untrained-0"
    assert json.loads((untrained / "adapter_config.json").read_text())["r"] == 4
    log_text = (tmp_path / "run" / "logs" / "sglang-0.log").read_text()
    assert f"policy={untrained}" in log_text  # --lora-paths
    trainer_log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    assert "published version 2 (adapter 'policy' only" in trainer_log
