"""Models and engines for the weight-bus tests: tiny Qwen2 models with large random weights (so two of
them generate differently), built-in engines in this process or in a subprocess that can be SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import torch

from generator_fleet.tasks.arith import ALPHABET, ArithTask
from model_zoo.tiny import build

KEY = "bus-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parents[2]


def noisy_model(path: Path, seed: int) -> torch.nn.Module:
    """A tiny model saved at `path` (tokenizer included); its weights get N(0, 0.5) noise in memory only,
    so a publish of it changes an engine's greedy output."""
    model, _ = build(path, ALPHABET, [p.prompt + str(p.answer) for p in ArithTask().problems], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def engine_weights(server) -> dict[str, torch.Tensor]:
    """What an in-process built-in engine computes with (its parameters, by HF name)."""
    return {n: t.detach().clone() for n, t in server.runner.model.state_dict().items()}


def assert_holds(server, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    """Bit for bit: every parameter of the engine equals the model's (cast to `dtype` if given)."""
    got = engine_weights(server)
    for name, p in model.state_dict().items():
        want = p if dtype is None else p.to(dtype)
        assert torch.equal(got[name], want.to(got[name].dtype)), name
        assert got[name].dtype == want.dtype, name


def remote_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    """What an engine in another process computes with (POST /get_weights_by_name, every row), as fp32."""
    out = {}
    for name in names:
        r = httpx.post(
            url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, headers=AUTH
        )
        r.raise_for_status()
        out[name] = torch.tensor(r.json(), dtype=torch.float32)
    return out


def version(url: str) -> str:
    return httpx.get(url + "/get_model_info", headers=AUTH, timeout=10).json()["weight_version"]


class EngineProcess:
    """`python -m generator_fleet.engine` in its own process (so it can really die); ready on return."""

    def __init__(
        self, model_dir: Path, log_path: Path, extra: list[str] | None = None, gpu: int | None = None
    ) -> None:
        """`extra`: more engine flags (e.g. `--lora <json>`); `gpu`: run on that CUDA device alone."""
        env = {
            **os.environ,
            **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        cmd = [sys.executable, "-m", "generator_fleet.engine", "--model", str(model_dir), "--port", "0"]
        cmd += ["--api-key", KEY, "--torch-threads", "1", "--log-level", "WARNING", *(extra or [])]
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in kill())
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT
        )
        line = "-"
        while line and not line.startswith("engine ready at "):  # "engine ready at URL"; "" if it died
            line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RuntimeError(f"engine did not start: {line!r}; see {log_path}")
        self.url = line.split()[-1]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(30)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.log.close()


def publish_bounded(bus, named, version: int, limit_s: float = 120.0):
    """bus.publish in a thread that must end within `limit_s` (so that a regression fails instead of
    hanging the suite)."""
    out: dict = {}

    def go() -> None:
        try:
            out["stats"] = bus.publish(named, version)
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), "publish hung"
    if "error" in out:
        raise out["error"]
    return out["stats"]
