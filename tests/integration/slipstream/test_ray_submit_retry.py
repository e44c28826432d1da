"""The control plane's Ray job submission when Ray's job server drops the connection (a kept-alive
connection it had closed, a server busy starting) or answers that its job agent is not up yet (a cluster
just started on a busy machine): tried again with the same submission id, so a driver starts at most once;
an answer that refuses it, or a server that keeps dropping it, ends in the API's 503.
The job store and Redis are real; Ray's job client is a stand-in recording what it was asked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests
from cluster_helpers import control_with_redis

from slipstream.cluster import control as control_mod
from slipstream.cluster.control import ControlError

DROPPED = requests.ConnectionError(("Connection aborted.", "Remote end closed connection without response"))
"""What requests raises for a kept-alive connection the server had closed."""
NO_AGENT = RuntimeError(
    "Request failed with status code 500: No available agent to submit job, please try again later."
)
"""The Ray SDK's error for its job server's answer while the job agent has not registered."""


class FlakyRay:
    """Fails the first `drops` submissions with `error` (DROPPED unless given), then takes them; or refuses
    every one with `refuse` (the SDK's RuntimeError for an HTTP error)."""

    def __init__(self, drops: int = 0, refuse: str | None = None, error: Exception = DROPPED) -> None:
        self.drops, self.refuse, self.error, self.calls, self.taken = drops, refuse, error, [], []

    def submit_job(self, **kw):
        self.calls.append(kw["submission_id"])
        if self.refuse:
            raise RuntimeError(self.refuse)
        if len(self.calls) <= self.drops:
            raise self.error
        self.taken.append(kw["submission_id"])

    def get_job_info(self, sid):
        if sid in self.taken:
            return SimpleNamespace(status="PENDING", message="")
        raise RuntimeError("Request failed with status code 404: Job not found")


@pytest.fixture
def control(tmp_path):
    (tmp_path / "jobs").mkdir()
    with control_with_redis(tmp_path) as (control, _):
        yield control


@pytest.mark.parametrize("error", [DROPPED, NO_AGENT], ids=["dropped", "no-agent"])
def test_a_dropped_submission_is_sent_again_with_the_same_id(control, error):
    control._ray = ray = FlakyRay(drops=2, error=error)
    control._send(SimpleNamespace(name="flaky"), "sid-1")
    assert ray.calls == ["sid-1"] * 3 and ray.taken == ["sid-1"]


def test_a_server_that_keeps_dropping_it_ends_in_503_after_the_tries(control):
    control._ray = ray = FlakyRay(drops=control_mod.SUBMIT_TRIES)
    with pytest.raises(ControlError) as e:
        control._send(SimpleNamespace(name="flaky"), "sid-2")
    assert e.value.status == 503 and "Connection aborted" in str(e.value)
    assert ray.calls == ["sid-2"] * control_mod.SUBMIT_TRIES and ray.taken == []


def test_a_refusal_is_not_tried_again(control):
    control._ray = ray = FlakyRay(refuse="Request failed with status code 400: bad runtime_env")
    with pytest.raises(ControlError) as e:
        control._send(SimpleNamespace(name="refused"), "sid-3")
    assert e.value.status == 503 and "status code 400" in str(e.value)
    assert ray.calls == ["sid-3"]
