"""The engine's step profiler (SGLang's /start_profile and /stop_profile): torch.profiler over the generation
thread's steps, each step labelled `prefill` or `decode`, so a trace shows where a step's time goes (kernels,
host work between them, the waits).

Started and stopped by the generation thread itself, between two steps (`at_boundary`), never by the HTTP
thread that asked: the profiler then sees every op of the steps it covers. It stops after `num_steps`
steps or on /stop_profile, and writes into the engine's profile directory (EngineOptions.profile_dir):
`<id>.trace.json.gz`, the Chrome/Perfetto trace, and `<id>-summary.txt`, the ops by their own time (device
time on CUDA) and the step labels' totals."""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUMMARY_ROWS = 60


class ProfileError(ValueError):
    """A /start_profile that cannot start (its message is the 400's)."""


class StepProfiler:
    def __init__(self, profile_dir: str | None, device: torch.device) -> None:
        self.dir = Path(profile_dir).resolve() if profile_dir else None
        self.device = device
        self._lock = threading.Lock()
        self._want: dict | None = None
        """A start asked for and not yet begun (output dir, steps, options)."""
        self._stop = False
        self._prof: torch.profiler.profile | None = None
        self._active: dict | None = None
        self._steps = 0

    def start(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        """Ask for a profile from the next step on (any thread); ProfileError when profiling is off, the
        directory is outside the engine's profile directory, or a profile is already running."""
        if self.dir is None:
            raise ProfileError("profiling is off: start the engine with --profile-dir")
        out = (self.dir / output_dir).resolve() if output_dir else self.dir
        if out != self.dir and self.dir not in out.parents:
            raise ProfileError(
                f"output_dir {output_dir!r} is outside the engine's profile directory {self.dir}"
            )
        if num_steps is not None and num_steps < 1:
            raise ProfileError(f"num_steps must be at least 1, got {num_steps}")
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        acts = [a.upper() for a in activities or ["CPU", "GPU"]]
        if unknown := [a for a in acts if a not in kinds]:
            raise ProfileError(f"activities {unknown} are not CPU or GPU")
        if self.device.type != "cuda":
            acts = [a for a in acts if a == "CPU"] or ["CPU"]
        with self._lock:
            if self._want is not None or self._prof is not None:
                raise ProfileError("a profile is already running: /stop_profile first")
            self._want = {
                "dir": out,
                "steps": num_steps,
                "activities": [kinds[a] for a in acts],
                "record_shapes": record_shapes,
                "with_stack": with_stack,
            }
            self._stop = False

    def stop(self) -> bool:
        """Ask the running (or asked-for) profile to end at the next step boundary; False when none runs."""
        with self._lock:
            if self._want is None and self._prof is None:
                return False
            self._stop = True
            return True

    @property
    def pending(self) -> bool:
        """A start or stop waits for the generation thread."""
        return self._want is not None or (self._stop and self._prof is not None)

    def at_boundary(self) -> None:
        """Between two steps, on the generation thread: begin an asked-for profile, end one asked to stop.
        A profile stopped before this thread began it is begun and ended here: its files say 0 steps, as
        /stop_profile's answer promised (on a busy host the stop can come before the thread woke)."""
        with self._lock:
            want, self._want = self._want, None
            stop = self._stop and (self._prof is not None or want is not None)
        if want is not None:
            self._prof = torch.profiler.profile(
                activities=want["activities"],
                record_shapes=want["record_shapes"],
                with_stack=want["with_stack"],
            )
            self._prof.__enter__()
            self._active, self._steps = want, 0
            log.info(
                "profiling started: %s steps into %s", want["steps"] or "until /stop_profile", want["dir"]
            )
        if stop:
            self.finish()

    def step(self, kind: str):
        """The context of one generation step: labelled in the profile while one runs; counts the step."""
        if self._prof is None:
            return contextlib.nullcontext()
        return self._counted(kind)

    @contextlib.contextmanager
    def _counted(self, kind: str):
        with torch.profiler.record_function(kind):
            yield
        self._steps += 1
        if self._active and self._active["steps"] is not None and self._steps >= self._active["steps"]:
            self.finish()

    def finish(self) -> None:
        """End the running profile (generation thread, or at shutdown) and write its files."""
        prof, active = self._prof, self._active
        with self._lock:
            self._prof = self._active = None
            self._stop = False
        if prof is None or active is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof.__exit__(None, None, None)
        out: Path = active["dir"]
        out.mkdir(parents=True, exist_ok=True)
        pid = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        trace, raw = out / f"{pid}.trace.json.gz", out / f".{pid}.trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        summary = out / f"{pid}-summary.txt"
        sort = (
            "self_cuda_time_total" if torch.profiler.ProfilerActivity.CUDA in active["activities"] else None
        )
        table = prof.key_averages().table(sort_by=sort or "self_cpu_time_total", row_limit=SUMMARY_ROWS)
        summary.write_text(f"{self._steps} steps profiled\n{table}\n")
        log.info("profiling stopped after %d steps: %s, %s", self._steps, trace, summary)
