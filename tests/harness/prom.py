"""A real Prometheus for the deploy tests (Debian's `prometheus` on PATH; callers skip without it)."""

import os
import subprocess
from pathlib import Path


def start_prometheus(config: Path, data_dir: Path, port: int, home: Path) -> subprocess.Popen:
    """Prometheus on 127.0.0.1:`port` with `config`, its TSDB in `data_dir`; HOME kept inside the test."""
    return subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home)},
    )
