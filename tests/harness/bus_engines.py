"""Models and engines for the weight-bus tests: tiny Qwen2 models with large random weights (so two of
them generate differently), built-in engines in this process or in a process of their own that can be
SIGKILLed."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import http_calls
import torch
from rank_runs import rank_context

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
        r = http_calls.post(
            url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}, headers=AUTH
        )
        r.raise_for_status()
        out[name] = torch.tensor(r.json(), dtype=torch.float32)
    return out


def version(url: str) -> str:
    return http_calls.get(url + "/get_model_info", headers=AUTH, timeout=10).json()["weight_version"]


class ForkedEngine:
    """`python -m generator_fleet.engine ARGV`'s entry point in a process of its own (so it can really
    die), forked from the test process's preloaded fork server (rank_runs.rank_context), which imported
    torch and the engine once: a start costs a fraction of a second instead of several CPU-seconds of
    imports. The child sends its output to `log_path`, where wait_ready() reads the engine's "engine
    ready at URL" line."""

    START_TIMEOUT_S = 120.0

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = Path(log_path)
        self.log_path.write_text("")
        self.proc = rank_context().Process(target=_engine_main, args=(argv, str(log_path), env))
        self.proc.start()
        self.url = ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not (url := _ready_url(self.log_path)):
            if self.proc.exitcode is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"engine did not start (exit code {self.proc.exitcode}); see {self.log_path}"
                )
            time.sleep(0.05)
        self.url = url

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (if it still runs); for SIGKILL and SIGTERM, wait (bounded) until it exited."""
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.wait(30)

    def wait(self, timeout_s: float) -> int | None:
        """Its exit code once it exited (None if it still runs after `timeout_s`)."""
        self.proc.join(timeout_s)
        return self.proc.exitcode


class EngineProcess(ForkedEngine):
    """A built-in engine of the weight-bus tests (key KEY, one torch thread) in its own forked process;
    ready on return."""

    def __init__(
        self, model_dir: Path, log_path: Path, extra: list[str] | None = None, gpu: int | None = None
    ) -> None:
        """`extra`: more engine flags (e.g. `--lora <json>`); `gpu`: run on that CUDA device alone."""
        env = {
            **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        argv = ["--model", str(model_dir), "--port", "0", "--api-key", KEY, "--torch-threads", "1"]
        argv += ["--log-level", "WARNING", *(extra or [])]
        super().__init__(argv, log_path, env)
        self.wait_ready()


def _ready_url(log_path: Path) -> str | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("engine ready at "):
            return line.split()[-1]
    return None


def _engine_main(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """(In the forked child.) The engine's own entry point, its stdout and stderr in `log_path`."""
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from generator_fleet.engine.__main__ import main

    main(argv)


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
