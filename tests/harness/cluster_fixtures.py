"""Fixtures of the cluster test modules: one real cluster per module that asks for `info`, and its client;
the demo's SFT-warmed tiny model, built once for the learning job tests."""

import os

import pytest
from cluster_helpers import running_cluster

from slipstream.cli.jobs import ControlClient


@pytest.fixture(scope="module")
def info():
    with running_cluster() as info:
        yield info


@pytest.fixture(scope="module")
def client(info):
    return ControlClient(info.api_url, info.api_token)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """Where the demo's tiny-arith model (SFT-warmed: it answers, badly) is built by the first job that
    uses it (model.build); later jobs load it. Under xdist the workers share it (the run's base temp
    directory): prepare_model's lock makes a job of another worker wait for the build instead of repeating
    it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / "demo_model" / "model"
