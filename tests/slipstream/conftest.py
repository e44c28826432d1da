"""Fixtures of the cluster test modules: one real cluster per module that asks for `info`, and its client."""

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
