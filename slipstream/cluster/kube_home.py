"""A head pod's HOME, for the pods of the manifests slipstream/cluster/kube.py renders: the control API
container runs `slipstream cluster kube-home` before the API, which reads the cluster from HOME as on a
host (slipstream/cluster/state.py), and so do the job drivers in the Ray head's container beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from slipstream.cluster.kube import SECRET_KEYS
from slipstream.cluster.state import ClusterState, private_dir


def write_home(home: str | Path, state_file: str | Path, env: dict[str, str] | None = None) -> Path:
    """Make HOME for the control API and the job drivers of a head pod: cluster.json from `state_file`
    (the ConfigMap's) and secrets.json (0600) from the Secret's variables in `env`; HOME."""
    env = os.environ if env is None else env
    home = Path(home)
    private_dir(home, home)
    for d in ("logs", "jobs", "prometheus/targets"):
        (home / d).mkdir(mode=0o700, parents=True, exist_ok=True)
    missing = [var for var in SECRET_KEYS.values() if not env.get(var)]
    if missing:
        raise RuntimeError(f"the Secret's variables are not set: {', '.join(missing)}")
    sec = {("ray_auth_token" if k == "auth_token" else k): env[var] for k, var in SECRET_KEYS.items()}
    msgspec.json.decode(Path(state_file).read_bytes(), type=ClusterState)  # a readable cluster.json
    tmp = home / "secrets.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(sec, f, indent=2)
    tmp.replace(home / "secrets.json")
    (home / "cluster.json.tmp").write_bytes(Path(state_file).read_bytes())
    (home / "cluster.json.tmp").replace(home / "cluster.json")
    return home
