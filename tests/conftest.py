"""The suite in three tiers, each folder mirroring the packages (tests/<tier>/<package>/test_*.py):

- `unit/`: one process (it may use the session's Redis or an in-process server); seconds in all.
- `integration/`: several real processes (gloo groups, HTTP engines, Redis restarts, a local Ray, a
  cluster's services), no whole training job.
- `system/`: whole jobs (`run_job`, a cluster running jobs, two nodes in network namespaces, the
  benchmarks' quick runs); marked `slow` here, so `make test-fast` (unit + integration) leaves them out.

Shared harnesses (engines, clusters, the weight-bus engines, network namespaces, raw HTTP, oracles) live in
tests/harness/, one module each, importable from every tier; their fixtures are plugins (`pytest_plugins`).
Here: a real private redis-server per test session, a fresh job namespace per test, the tiny models built
once, and the per-test durations file."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "harness"))
pytest_plugins = ["bus_fixtures", "cluster_fixtures", "engine_fixtures", "multinode_fixtures", "ray_fixtures"]
TIERS = ("unit", "integration", "system")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Untrained tiny arithmetic model + tokenizer (seeded), shared by the tests that need weights."""
    from generator_fleet.tasks.arith import ALPHABET, ArithTask
    from model_zoo.tiny import build

    path = tmp_path_factory.mktemp("tiny_model")
    task = ArithTask()
    build(path, ALPHABET, [p.prompt + str(p.answer) for p in task.problems], seed=0)
    return path


TOOLS_WARMUP_STEPS = 200


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """The tiny tool model (ChatML, calculator calls) after a short SFT warm-up: it calls the calculator on
    some easy word problems and guesses on others."""
    import torch

    from generator_fleet.tasks.word_problems import WordProblemTask
    from model_zoo.tiny_tools import build_tiny_tools

    path = tmp_path_factory.mktemp("tools_model")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the SFT warm-up on every core, whatever ran before
    try:
        build_tiny_tools(
            path, WordProblemTask(2000, seed=1, difficulty="easy").problems, warmup_steps=TOOLS_WARMUP_STEPS
        )
    finally:
        torch.set_num_threads(threads)
    return path


@pytest.fixture(scope="session")
def untrained_tools_model_dir(tmp_path_factory):
    """The tiny tool model's tokenizer and ChatML layout with random weights (no warm-up): what it writes
    is noise unless a grammar constrains it."""
    from model_zoo.tiny_tools import build_tiny_tools

    class Problem:
        prompt, expression, answer = "What is 2 plus 3?", "2+3", 5

    path = tmp_path_factory.mktemp("untrained_tools")
    build_tiny_tools(path, [Problem()], warmup_steps=0)
    return path


def pytest_collection_modifyitems(config, items) -> None:
    """The folder says the tier: every test under tests/system/ is `slow`."""
    for item in items:
        if TESTS / "system" in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


# ---- test durations: every test's setup + call + teardown time, slowest first, written to DURATIONS_FILE
# at the end of a run (`make test` prints its head, so CI's log shows where the suite's time goes).
DURATIONS_FILE = "test-durations.txt"
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if not _durations or hasattr(session.config, "workerinput"):
        return
    total = sum(_durations.values())
    rows = sorted(_durations.items(), key=lambda kv: kv[1], reverse=True)
    lines = [f"{len(rows)} tests, {total:.0f} s in tests (setup + call + teardown), slowest first"]
    lines += [f"{seconds:8.1f} s  {nodeid}" for nodeid, seconds in rows]
    with open(session.config.rootpath / DURATIONS_FILE, "w") as f:
        f.write("\n".join(lines) + "\n")
