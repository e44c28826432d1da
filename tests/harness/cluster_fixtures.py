"""Fixtures of the cluster test modules: one real cluster per module that asks for `info`, and its client;
the demo's SFT-warmed tiny model, built once for the learning job tests."""

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
    uses it (model.build); later jobs load it."""
    return tmp_path_factory.mktemp("demo_model") / "model"
