"""deploy/slurm/slipstream.sbatch: valid bash, and every flag it gives `slipstream cluster up|down` and
`ray start` is one those commands take (their --help), so a renamed flag breaks this test, not a
cluster's start on a batch system."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "deploy" / "slurm" / "slipstream.sbatch"


def _commands(prefix: str) -> list[str]:
    """Each command line of the script starting with `prefix`, its continuation lines joined."""
    lines = SBATCH.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if re.search(
            rf"(^|\s|\|\||&&|exec ){re.escape(prefix)}(\s|$)", line
        ) and not line.lstrip().startswith("#"):
            cmd = line
            j = i
            while cmd.rstrip().endswith("\\"):
                j += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[j]
            out.append(cmd[cmd.index(prefix) :])
    return out


def _flags(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command))


def _help(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, *args, "--help"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_sbatch_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert SBATCH.read_text().startswith("#!/bin/bash\n")
    assert re.search(r"^#SBATCH --nodes=\d+", SBATCH.read_text(), re.M)


@pytest.mark.parametrize("sub", ["up", "down"])
def test_cluster_flags_exist(sub):
    commands = _commands(f"slipstream cluster {sub}")
    assert commands, f"the script runs no `slipstream cluster {sub}`"
    known = _flags(_help("-m", "slipstream", "cluster", sub))
    used = set().union(*map(_flags, commands))
    assert used and used <= known, f"not flags of `slipstream cluster {sub}`: {used - known}"


def test_ray_start_flags_exist_and_workers_are_labelled():
    commands = _commands("ray start")
    assert len(commands) == 1
    known = _flags(_help("-m", "ray.scripts.scripts", "start"))
    used = _flags(commands[0])
    assert used <= known, f"not flags of `ray start`: {used - known}"
    assert {"--address", "--resources", "--num-gpus", "--block"} <= used
    from slipstream.cluster.kube import ENGINE_RESOURCE, TRAINER_RESOURCE

    text = SBATCH.read_text()
    assert f"role={ENGINE_RESOURCE}" in text and f"role={TRAINER_RESOURCE}" in text
    # the head's and the workers' Ray port are the same variable
    assert '--ray-port "$RAY_PORT"' in text and "$head_ip:$RAY_PORT" in text
