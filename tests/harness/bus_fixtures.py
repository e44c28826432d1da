"""Fixtures shared by the weight-bus tests."""

import pytest
from bus_engines import noisy_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny noisy model (seed 1) saved once per test module: what the engines start from."""
    path = tmp_path_factory.mktemp("bus") / "a"
    noisy_model(path, 1)
    return path
