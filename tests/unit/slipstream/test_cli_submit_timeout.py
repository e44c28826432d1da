"""`slipstream submit` waits for the control API as long as the API may take to hand a job to Ray: up to
SUBMIT_TRIES tries, each of which Ray's job server may hold for the wait on its job agent (a cluster just
started on a busy machine). The other calls keep the client's shorter timeout."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import serving
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from slipstream.cli import jobs
from slipstream.cluster import control

DELAY_S = 1.0
"""How long the stand-in control API takes to answer: four times the client's timeout in the test."""


async def _slow(request):
    await asyncio.sleep(DELAY_S)
    return JSONResponse({"name": "slow", "state": "submitted"})


def test_submit_outwaits_the_timeout_of_the_other_calls():
    app = Starlette(routes=[Route("/jobs", _slow, methods=["POST"]), Route("/jobs/{name}", _slow)])
    with serving(app) as url:
        client = jobs.ControlClient(url, "token", timeout_s=DELAY_S / 4)
        assert client.submit("name: slow", [], "/")["state"] == "submitted"
        with pytest.raises(jobs.ApiError, match="timed out"):
            client.get("slow")


def test_submit_waits_longer_than_every_try_of_the_control_api():
    from ray.dashboard.consts import WAIT_AVAILABLE_AGENT_TIMEOUT  # Ray's wait for its job agent, per try

    backoffs = sum(control.SUBMIT_BACKOFF_S * attempt for attempt in range(1, control.SUBMIT_TRIES))
    worst = control.SUBMIT_TRIES * WAIT_AVAILABLE_AGENT_TIMEOUT + backoffs
    assert jobs.SUBMIT_TIMEOUT_S >= 2 * worst  # and room for the API's own Redis and Ray status calls
