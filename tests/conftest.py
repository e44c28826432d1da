"""The suite in three tiers, each folder mirroring the packages (tests/<tier>/<package>/test_*.py):

- `unit/`: one process (it may use the session's Redis or an in-process server); seconds in all.
- `integration/`: several real processes (gloo groups, HTTP engines, Redis restarts, a local Ray, a
  cluster's services), no whole training job.
- `system/`: whole jobs (`run_job`, a cluster running jobs, two nodes in network namespaces, the
  benchmarks' quick runs); marked `slow` here, so `make test-fast` (unit + integration) leaves them out.

Shared harnesses (engines, clusters, the weight-bus engines, network namespaces, raw HTTP, oracles) live in
tests/harness/, one module each, importable from every tier; their fixtures are plugins (`pytest_plugins`).
Here: a real private redis-server per test session, a fresh job namespace per test, the tiny models built
once, and the per-test durations file.

`make test` runs the tiers in `TEST_WORKERS` processes (3 unless set; pytest-xdist, `--dist loadfile`: a file's
tests stay in one process, so a module's cluster or engines start once); whole-job files are handed out first, the short unit
tests fill the gaps at the end. Each process has its own Redis, Ray and job namespaces; the tiny models are
built once for the whole run (`built_once`)."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "harness"))
pytest_plugins = ["bus_fixtures", "cluster_fixtures", "engine_fixtures", "multinode_fixtures", "ray_fixtures"]
TIERS = ("unit", "integration", "system")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per test process and per process it starts (set before anything imports torch): the
# suite runs several processes per core, and torch's default (a thread per core in each) has every process's
# threads spin at each parallel region's barrier waiting for threads that are not running. On 2 cores with
# 3 workers the in-process engine and trainer tests took 80 s and 149 CPU-s that way, 47 s and 81 CPU-s with
# one thread. Ray actors and the engines' --torch-threads set their own; a test that wants more sets them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No cyclic garbage collector until the collection ends (pytest_collection below): the plugins' and test
# modules' imports (torch, transformers, ray) take a third less CPU without its passes over what they load
# (common/startup.py; the suite's collection in one process: 11.1 s, 7.7 s), in each of the run's processes.
gc.disable()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    try:
        return (yield)
    finally:
        gc.enable()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from replay_buffer.redis_server import ManagedRedis

    with ManagedRedis(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def job_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that `build(path)` fills once per pytest run, read (never written) by the tests. Under
    xdist the worker processes share it: the first to get there builds it under a file lock, the others wait
    for it and reuse it (the run's base temp directory, shared by the workers, holds it)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent
    path, done = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Untrained tiny arithmetic model + tokenizer (seeded), shared by the tests that need weights."""
    from generator_fleet.tasks.arith import ALPHABET, ArithTask
    from model_zoo.tiny import build

    task = ArithTask()
    return built_once(
        tmp_path_factory,
        "tiny_model",
        lambda path: build(path, ALPHABET, [p.prompt + str(p.answer) for p in task.problems], seed=0),
    )


TOOLS_WARMUP_STEPS = 100


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """The tiny tool model (ChatML, calculator calls) after a short SFT warm-up: it calls the calculator on
    some easy word problems and guesses on others."""
    import torch

    from generator_fleet.tasks.word_problems import WordProblemTask
    from model_zoo.tiny_tools import build_tiny_tools

    def build(path: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)  # the SFT warm-up on every core, whatever ran before
        try:
            build_tiny_tools(
                path,
                WordProblemTask(2000, seed=1, difficulty="easy").problems,
                warmup_steps=TOOLS_WARMUP_STEPS,
            )
        finally:
            torch.set_num_threads(threads)

    return built_once(tmp_path_factory, "tools_model", build)


@pytest.fixture(scope="session")
def untrained_tools_model_dir(tmp_path_factory):
    """The tiny tool model's tokenizer and ChatML layout with random weights (no warm-up): what it writes
    is noise unless a grammar constrains it."""
    from model_zoo.tiny_tools import build_tiny_tools

    class Problem:
        prompt, expression, answer = "What is 2 plus 3?", "2+3", 5

    return built_once(
        tmp_path_factory, "untrained_tools", lambda path: build_tiny_tools(path, [Problem()], warmup_steps=0)
    )


def tier(item) -> str:
    """The tier a test belongs to: the folder under tests/ it lives in."""
    try:
        return Path(item.fspath).relative_to(TESTS).parts[0]
    except ValueError:  # a test file outside tests/, named on the command line
        return ""


def pytest_collection_modifyitems(config, items) -> None:
    """The folder says the tier: every test under tests/system/ is `slow`, and the two-node tests
    (tests/system/multinode/: two Ray nodes and a cluster in network namespaces, whose `ray start` gives up
    after 30 s on a starved box) are `serial`: `make test` runs them after the parallel part, alone. The order
    is system, integration, unit (each in file order), so that parallel workers take the long whole-job
    files first."""
    for item in items:
        if tier(item) == "system":
            item.add_marker(pytest.mark.slow)
        if TESTS / "system" / "multinode" in Path(item.fspath).parents:
            item.add_marker(pytest.mark.serial)
    rank = {name: i for i, name in enumerate(reversed(TIERS))}
    items.sort(key=lambda item: rank.get(tier(item), len(TIERS)))


# ---- test durations: every test's setup + call + teardown time, slowest first, written to DURATIONS_FILE
# at the end of a run (`make test` prints its head, so CI's log shows where the suite's time goes).
DURATIONS_FILE = "test-durations.txt"
DURATIONS_MERGE = "SLIPSTREAM_TEST_DURATIONS_MERGE"
"""Set (by the Makefile) for a later pytest run of one `make test`: its durations join the file's."""
_durations: dict[str, float] = {}


def read_durations(path: Path) -> dict[str, float]:
    """Test id -> seconds, from a durations file (empty when there is none)."""
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            seconds, sep, nodeid = line.strip().partition(" s  ")
            if sep:
                out[nodeid] = float(seconds)
    return out


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if not _durations or hasattr(session.config, "workerinput"):
        return
    path = session.config.rootpath / DURATIONS_FILE
    if os.environ.get(DURATIONS_MERGE):  # a later part of one `make test`: keep the earlier part's
        for nodeid, seconds in read_durations(path).items():
            _durations.setdefault(nodeid, seconds)
    total = sum(_durations.values())
    rows = sorted(_durations.items(), key=lambda kv: kv[1], reverse=True)
    tiers: dict[str, float] = {}
    for nodeid, seconds in rows:
        name = nodeid.split("/")[1] if nodeid.startswith("tests/") else "other"
        tiers[name] = tiers.get(name, 0.0) + seconds
    lines = [
        f"{len(rows)} tests, {total:.0f} s in tests (setup + call + teardown; summed over parallel workers)"
    ]
    lines += [f"  {name}: {seconds:.0f} s" for name, seconds in sorted(tiers.items())]
    lines += ["slowest first:"]
    lines += [f"{seconds:8.1f} s  {nodeid}" for nodeid, seconds in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
