"""The result file every benchmark writes (benchmarks/README.md, Result files): its name, its skeleton, saving it."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class ResultFile:
    """`benchmarks/results/<benchmark>-<device>[-<label>]-<YYYYMMDD>.json`: `result` holds what was measured
    so far; `save()` writes it (benchmarks save after every measurement and on every way out)."""

    def __init__(
        self,
        benchmark: str,
        device_kind: str,
        argv: list[str],
        out_dir: Path,
        label: str | None = None,
        append: bool = False,
        **fields: Any,
    ) -> None:
        """append: today's file of the same benchmark, device and label, when there is one, is loaded and
        added to (a benchmark run as several phase commands, each short enough for one device call); its
        commands are listed in `commands`."""
        today = datetime.date.today()
        # a benchmark that is a package runs as a module
        package = (Path(__file__).parent / benchmark / "__main__.py").exists()
        program = ["-m", f"benchmarks.{benchmark}"] if package else [f"benchmarks/{benchmark}.py"]
        self.path = out_dir / f"{benchmark}-{device_kind}{f'-{label}' if label else ''}-{today:%Y%m%d}.json"
        self.result: dict[str, Any] = {
            "benchmark": benchmark,
            "device": device_kind,
            "date": today.isoformat(),
            "command": shlex.join(["python", *program, *argv]),
            "config": {},
            "metrics": {},
            "ratios": {},
            "errors": [],
        }
        self.result.update(fields)  # e.g. config=...: keeps the key order above
        if append and self.path.exists():  # one phase of several: what the earlier commands measured stays
            earlier = json.loads(self.path.read_text())
            commands = earlier.get("commands") or [earlier.get("command")]
            earlier["commands"] = [*commands, self.result["command"]]
            earlier["command"] = self.result["command"]
            self.result = earlier

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.result, indent=2) + "\n")

    @contextlib.contextmanager
    def recording(
        self,
        log: Callable[[str], None],
        t_start: float | None = None,
        finish: Callable[[], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Around a benchmark's measurements, so that what was measured is written on every way out: an
        exception goes into `errors` (with the end of its traceback) and is saved at once; an Exception
        ends here, a KeyboardInterrupt goes on. Then `finish()` runs (summaries, plots), the wall time
        since `t_start` (time.monotonic) and the host load go into `config`, the file is saved and its
        path logged."""
        try:
            yield self.result
        except BaseException as exc:
            self.result["errors"].append(
                {"error": repr(exc), "traceback": traceback.format_exception(exc)[-4:]}
            )
            self.save()
            if not isinstance(exc, Exception):
                raise
        finally:
            if finish is not None:
                finish()
            config = self.result["config"]
            if isinstance(config.get("env"), dict):
                config["env"]["host_load_1m_end"] = os.getloadavg()[0]
            if t_start is not None:
                config["wall_s"] = time.monotonic() - t_start
            self.save()
            log(f"wrote {self.path}")


def apply_presets(args: Any, defaults: dict, cuda: dict, quick: dict) -> None:
    """Fill every option the user left unset (None) from the presets: `defaults`, overridden by `cuda` on
    --device cuda, overridden by `quick` with --quick."""
    presets = {**defaults, **(cuda if args.device == "cuda" else {}), **(quick if args.quick else {})}
    for key, value in presets.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
