"""A built-in engine in its own process for the IPC handoff tests: it serves over HTTP like any engine
and, asked for a dump, writes the weights it computes with to a file (torch.save). `IpcEngine` forks it
from the test process's preloaded fork server (rank_runs.rank_context: torch and the engine imported
once) and talks to it over a pipe."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from rank_runs import rank_context

START_TIMEOUT_S = 120.0


class IpcEngine:
    """A built-in engine in its own process whose weights the test can read back (`weights()`), and which
    can really die (`kill()`)."""

    def __init__(self, model_dir: Path, tmp: Path, key: str, device: str = "cpu") -> None:
        self.tmp = tmp
        ctx = rank_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(str(model_dir), key, device, child))
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"engine did not start within {START_TIMEOUT_S:.0f} s")
        self.url = self.conn.recv()

    def weights(self) -> dict[str, torch.Tensor]:
        path = self.tmp / f"weights-{self.proc.pid}.pt"
        self.conn.send(str(path))
        assert self.conn.recv() == "dumped"
        return torch.load(path, map_location="cpu")

    def send_signal(self, sig: int) -> None:
        """Send it `sig` (SIGKILL, SIGSTOP, SIGCONT, ...) if it still runs."""
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self.proc.join(30)
        self.conn.close()


def _serve(model_dir: str, key: str, device: str, conn) -> None:
    """(In the forked child.) Serve until the pipe closes; each path received gets the weights dumped."""
    from generator_fleet.engine import EngineServer

    os.environ.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    server = EngineServer(model_dir, api_key=key, torch_threads=1, device=device).start()
    conn.send(server.url)
    try:
        while True:
            path = conn.recv()
            weights = {n: t.detach().clone() for n, t in server.runner.model.state_dict().items()}
            torch.save(weights, path)
            conn.send("dumped")
    except EOFError:  # the test closed its end
        pass
    server.stop()
    os._exit(0)
