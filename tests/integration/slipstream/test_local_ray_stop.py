"""A private Ray ends with every process it started: stop_local_ray (what `slipstream run` and LocalJob
call) shuts Ray down, waits for the processes that came after the Ray's start and kills what is still
running (here a child that ignores SIGTERM stands for a worker slow to notice its raylet is gone: CI saw
`slipstream run` return with a rollout worker still running), with a warning naming it. A child this
process had before the Ray started (the job's managed Redis) is left alone. In a process of its own: the
test session's shared Ray is not touched. The Ray starts no idle workers ahead: the actor has a worker of
its own, and none sits idle beside it."""

import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import subprocess, sys, time, psutil, ray
from slipstream.job.prepare import init_local_ray, own_processes, stop_local_ray

before = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL)  # a child from before the Ray (Redis)
existing = own_processes()
init_local_ray(num_cpus=1)

@ray.remote(num_cpus=0)
class Actor:
    def pid(self) -> int:
        import os
        return os.getpid()

handle = Actor.remote()
actor = ray.get(handle.pid.remote())
time.sleep(2)  # a worker Ray prestarts is up within a second of the driver
idle = []
for p in psutil.Process().children(recursive=True):
    try:
        idle += [p.pid] if p.cmdline()[:1] == ["ray::IDLE"] else []
    except psutil.NoSuchProcess:
        pass
print("idle", *idle, flush=True)
slow = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
started = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in existing]
print("started", *started, flush=True)
print("actor", actor, "slow", slow.pid, flush=True)
print("killed", *stop_local_ray(existing, wait_s=float(sys.argv[1])), flush=True)
print("before", before.poll(), flush=True)
before.kill()
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_local_ray_leaves_no_process_it_started_and_only_those():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, "2"], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines() if line.strip()}
    started, killed = set(map(int, out["started"])), set(map(int, out["killed"]))
    actor, slow = int(out["actor"][0]), int(out["actor"][2])
    assert {actor, slow} <= started and len(started) > 3  # Ray's daemons, its workers and the slow child
    assert out["idle"] == []  # no worker started ahead of an actor
    assert slow in killed and actor not in killed  # the actor's worker went with its raylet
    assert not any(_running(pid) for pid in started)  # nothing it started still runs
    assert out["before"] == ["None"]  # the older child still ran when stop_local_ray returned
    assert f"(pid {slow}) still ran 2 s after ray.shutdown: killing it" in run.stderr
