"""Engines that Slipstream does not run in its own process: real SGLang servers the fleet launches as
subprocesses (`generators.engine: sglang`), engines someone else runs (`engine: external`), and an
sglang-router in front of either. All of them speak SGLang's native HTTP API, so the rollout workers'
EngineClient and the trainer's weight bus drive them exactly like the built-in engine.

Where requests go (slime and AReaL drive SGLang the same way): rollout requests go to the router when
there is one, else straight to the engines; pause, continue and weight updates always go to each engine
("worker"), because the router does not forward them (docs/sglang_api.md §5).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from generator_fleet.launch_options import SGLangOptions
from models.config import LoraSpec
from weight_bus.engine_client import EngineClient, auth_headers
from weight_bus.registry import DEFAULT_LEASE_S, EngineRegistration

log = logging.getLogger(__name__)

ENGINE_HOST = "127.0.0.1"
INITIAL_WEIGHT_VERSION = "0"
"""--weight-version at launch: the built-in engine's, so token versions parse as integers from the
first token on (SGLang's default, "default", would tag them -1 until the first update)."""
HEALTH_POLL_S = 0.5
"""How often a starting server is asked GET /health: a subprocess offers no readiness event to wait on."""
HEALTH_TIMEOUT_S = 10.0
"""One /health call (SGLang 0.5.3's /health runs a 1-token generation, so it can take a moment)."""
ATTACH_TIMEOUT_S = 60.0
"""How long external engines may take to answer /health when a job attaches to them."""
STOP_TIMEOUT_S = 30.0
"""SIGTERM grace before SIGKILL: SGLang tears down its scheduler and detokenizer processes on SIGTERM."""
LOG_TAIL_LINES = 40

# Run the server under this one-liner: it asks the kernel to SIGTERM the server when the process that
# launched it dies (ray.kill is a SIGKILL: no Python cleanup runs), then execs the real command in place.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # 1 = PR_SET_PDEATHSIG
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


class EngineStartError(RuntimeError):
    """An engine did not become healthy; the message carries the tail of its log when there is one."""


LORAS_PER_BATCH = 2
"""SGLang's --max-loras-per-batch for a LoRA job: the job's adapter and the base model (SGLang counts
base-only requests as one adapter)."""


def sglang_command(
    model_path: str,
    port: int,
    sg: SGLangOptions,
    api_key: str | None = None,
    host: str = ENGINE_HOST,
    lora: LoraSpec | None = None,
    initial_adapter: str | None = None,
) -> list[str]:
    """`python -m sglang.launch_server ...` for one engine. Flag names are SGLang's (ServerArgs fields in
    python/sglang/srt/server_args.py, `tp_size` -> `--tp-size`); options left null are left to SGLang.
    `lora` (a LoRA job): --enable-lora sized for the adapter (--max-lora-rank, --lora-target-modules) and
    --max-loras-per-batch 2 (SGLang counts the base model as one: the adapter plus base requests);
    `initial_adapter`: a PEFT directory the server loads at start as adapter `lora.name` (--lora-paths
    NAME=PATH: a LoRA job's untrained adapter, write_untrained_adapter)."""
    cmd = [
        sg.python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        sg.dtype,
        "--tp-size",
        str(sg.tp_size),
        "--weight-version",
        INITIAL_WEIGHT_VERSION,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    if sg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if sg.context_length is not None:
        cmd += ["--context-length", str(sg.context_length)]
    if sg.served_model_name is not None:
        cmd += ["--served-model-name", sg.served_model_name]
    if sg.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if sg.enable_metrics:
        cmd.append("--enable-metrics")
    if sg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if sg.enable_weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if sg.enable_fp32_lm_head:
        cmd.append("--enable-fp32-lm-head")

    if lora is not None:
        cmd += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora.rank),
            "--lora-target-modules",
            *lora.target_modules,
        ]
        cmd += ["--max-loras-per-batch", str(LORAS_PER_BATCH)]
        if initial_adapter is not None:
            cmd += ["--lora-paths", f"{lora.name}={initial_adapter}"]
    return cmd + list(sg.extra_args)


def write_untrained_adapter(model_path: str, lora: LoraSpec, path: str | Path) -> Path:
    """A LoRA job's version 0 for engines that load adapters from disk: a PEFT directory at `path` with
    the adapter's every tensor zero (B = 0 makes the adapted model the base model, whatever A is)."""
    import torch
    from transformers import AutoConfig

    from generator_fleet.engine.lora import module_dims
    from weight_bus.lora import write_adapter_dir

    cfg = AutoConfig.from_pretrained(model_path)
    dims = module_dims(cfg)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for mod in lora.target_modules:
            block = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{i}.{block}.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(lora.rank, dims[mod][0])
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(dims[mod][1], lora.rank)
    return write_adapter_dir(Path(path), tensors, lora.peft_config())


def redact(cmd: list[str]) -> list[str]:
    """The command with the --api-key value hidden (for logs)."""
    return [a if prev != "--api-key" else "***" for prev, a in zip([None, *cmd], cmd, strict=False)]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def is_healthy(url: str, api_key: str | None = None, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """GET {url}/health answers 200, through the engines' one control client."""
    with EngineClient(api_key, timeout_s) as client:
        return client.healthy(url)


def wait_healthy(
    url: str,
    timeout_s: float,
    api_key: str | None = None,
    exited: Callable[[], int | None] = lambda: None,
) -> None:
    """Return once GET {url}/health answers 200 (SGLang answers 503 while it starts). Raises
    EngineStartError when `exited()` reports an exit code first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url, api_key, timeout_s=min(HEALTH_TIMEOUT_S, timeout_s)):
        if (code := exited()) is not None:
            raise EngineStartError(f"exited with code {code}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer GET /health with 200 within {timeout_s:.0f} s")
        time.sleep(HEALTH_POLL_S)


class SGLangServer:
    """One `python -m sglang.launch_server` subprocess: `start()` launches it with its output in
    `log_path` and returns once it is healthy; `stop()` sends SIGTERM to its process group, then SIGKILL."""

    def __init__(
        self,
        model_path: str,
        sg: SGLangOptions,
        log_path: str | Path,
        api_key: str | None = None,
        port: int = 0,
        env: dict[str, str] | None = None,
        lora: LoraSpec | None = None,
        initial_adapter: str | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.sg = sg
        self.lora = lora
        """The job's adapter shape: the server starts with LoRA enabled for it (None: no LoRA)."""
        self.initial_adapter = initial_adapter
        """A PEFT directory loaded at start as adapter `lora.name` (a LoRA job's untrained adapter)."""
        self.log_path = Path(log_path)
        self.api_key = api_key
        self.port = port
        """0 until start() when 0 was asked: then a free port picked at launch."""
        self.env = env
        """Extra environment for the server (on top of ours, which carries Ray's CUDA_VISIBLE_DEVICES)."""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{ENGINE_HOST}:{self.port}"

    def command(self) -> list[str]:
        return sglang_command(
            self.model_path,
            self.port,
            self.sg,
            self.api_key,
            lora=self.lora,
            initial_adapter=self.initial_adapter,
        )

    def start(self) -> SGLangServer:
        from common.net import free_port

        if not self.port:
            self.port = free_port(ENGINE_HOST)
        cmd = self.command()
        if sys.platform == "linux":
            cmd = [sys.executable, "-c", _DIE_WITH_PARENT, *cmd]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"=== slipstream: launching {' '.join(redact(self.command()))}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,  # its own process group: stop() reaches SGLang's child processes too
            )
        log.info("sglang server pid %d launching at %s (log %s)", self.proc.pid, self.url, self.log_path)
        try:
            wait_healthy(self.url, self.sg.startup_timeout_s, self.api_key, exited=self.proc.poll)
        except (EngineStartError, TimeoutError) as e:
            self.stop()
            raise EngineStartError(
                f"sglang server for {self.model_path} at {self.url} did not start: {e}; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            ) from e
        log.info("sglang server at %s is healthy", self.url)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # session leader, so its pid is the group id
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:  # the whole group is gone
                break
            try:
                self.proc.wait(timeout_s)
                if sig == signal.SIGTERM:
                    # The leader is gone; sweep any child it left behind (a no-op when there is none).
                    os.killpg(pgid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                log.warning("sglang server pid %d ignored SIGTERM for %.0f s; killing it", pgid, timeout_s)
            except ProcessLookupError:
                break
        self.proc.wait()
        log.info("sglang server at %s stopped (exit code %s)", self.url, self.proc.returncode)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HealthCheckedRegistration(EngineRegistration):
    """A registry lease renewed only while the engine answers GET /health (and `alive()` holds): an
    engine Slipstream does not run in-process could die or hang without its lease noticing otherwise.
    A failed check just skips one renewal, so it takes ~3 in a row before rollout workers drop it."""

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        url: str,
        lease_s: float = DEFAULT_LEASE_S,
        api_key: str | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.api_key, self.alive = api_key, alive
        super().__init__(client, job, url, lease_s)

    def renew(self) -> None:
        if self.alive() and is_healthy(self.url, self.api_key):
            super().renew()
        else:
            log.warning("engine %s failed its health check; lease not renewed", self.url)


# ---- sglang-router (Rust): its admin API, as in sgl-router's server.rs ----------------------------------


def router_workers(router_url: str, api_key: str | None = None) -> list[str]:
    """The worker URLs behind an sglang-router (GET /list_workers -> {"urls": [...]})."""
    resp = httpx.get(f"{router_url}/list_workers", headers=auth_headers(api_key), timeout=HEALTH_TIMEOUT_S)
    resp.raise_for_status()
    return [u.rstrip("/") for u in resp.json()["urls"]]


def router_add_worker(router_url: str, url: str, api_key: str | None = None) -> None:
    """POST /add_worker?url=...; `api_key` is the worker's, for the router to call it with."""
    params = {"url": url, **({"api_key": api_key} if api_key else {})}
    resp = httpx.post(
        f"{router_url}/add_worker", params=params, headers=auth_headers(api_key), timeout=ATTACH_TIMEOUT_S
    )
    if resp.status_code != 200:
        raise EngineStartError(f"router {router_url} refused worker {url}: {resp.status_code} {resp.text}")


def router_remove_worker(router_url: str, url: str, api_key: str | None = None) -> None:
    """POST /remove_worker?url=...; teardown: a router that is gone or refuses only gets a warning."""
    try:
        resp = httpx.post(
            f"{router_url}/remove_worker",
            params={"url": url},
            headers=auth_headers(api_key),
            timeout=HEALTH_TIMEOUT_S,
        )
    except httpx.HTTPError as e:
        log.warning("router %s unreachable while removing worker %s: %s", router_url, url, e)
        return
    if resp.status_code != 200:
        log.warning("router %s did not remove worker %s: %s %s", router_url, url, resp.status_code, resp.text)


class ExternalEngines:
    """Attach a job to engines someone else runs: each must answer /health, then this holds the registry
    leases of what rollout workers should call, the router if there is one, else every engine."""

    def __init__(
        self,
        urls: list[str],
        router_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = ATTACH_TIMEOUT_S,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.registrations: list[HealthCheckedRegistration] = []

    def attach(self, client: redis.Redis, job: str) -> list[str]:
        """Health-check, register, and return the engine (worker) URLs: the ones the weight bus updates."""
        if self.router_url:
            wait_healthy(self.router_url, self.timeout_s, self.api_key)
        workers = self.urls or router_workers(self.router_url, self.api_key)
        if not workers:
            raise EngineStartError(f"router {self.router_url} lists no workers")
        for url in workers:
            try:
                wait_healthy(url, self.timeout_s, self.api_key)
            except TimeoutError as e:
                raise EngineStartError(f"external engine {url} is not healthy: {e}") from e
        routable = [self.router_url] if self.router_url else workers
        self.registrations = [
            HealthCheckedRegistration(client, job, u, self.lease_s, self.api_key) for u in routable
        ]
        log.info("attached to external engines %s (requests go to %s)", workers, routable)
        return workers

    def detach(self) -> None:
        for reg in self.registrations:
            reg.close()
        self.registrations = []
