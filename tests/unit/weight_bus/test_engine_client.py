"""The engines' control routes through weight_bus.engine_client, against a real built-in engine: pause and
continue, answers that are not a success raise Refused naming the engine and the route, the pipelined
channel keeps its calls in order, and continuing engines a dead trainer left paused reports the engines
that could not be reached. A probe whose connection breaks is tried once more on a new connection (a
timeout is not). Importing the client (and the package) stays free of torch."""

import subprocess
import sys

import httpx
import pytest
from bus_engines import KEY, ROOT
from raw_http import scripted_server

from common.net import free_port
from generator_fleet.engine import EngineServer
from weight_bus import metrics
from weight_bus.engine_client import EngineClient, continue_engines
from weight_bus.errors import BusError, Refused


@pytest.fixture(scope="module")
def engine(model_dir):
    server = EngineServer(str(model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def test_pause_then_continue(engine):
    with EngineClient(KEY, timeout_s=10) as client:
        client.pause_generation(engine.url, "in_place")
        assert engine.runner.paused
        assert client.continue_generation(engine.url)["status"] == "ok"
        assert not engine.runner.paused


def test_an_answer_that_is_not_a_success_is_refused(engine):
    with EngineClient(KEY, timeout_s=10) as client:
        with pytest.raises(Refused, match=r"/pause_generation: HTTP 400: .*pause mode 'sleep'") as err:
            client.pause_generation(engine.url, "sleep")
        assert engine.url in str(err.value) and isinstance(err.value, BusError)
        assert not engine.runner.paused
    with EngineClient("wrong", timeout_s=10) as client:
        with pytest.raises(Refused, match="/get_server_info: HTTP 401"):
            client.server_info(engine.url)


def test_channel_calls_answer_in_order(engine):
    with EngineClient(KEY, timeout_s=10) as client:
        channel = client.channel(engine.url)
        try:
            pause = channel.call("/pause_generation", {"mode": "in_place"})
            refused = channel.call("/pause_generation", {"mode": "sleep"})
            resume = channel.call("/continue_generation", {})
            assert pause.result(10)["status"] == "ok"
            with pytest.raises(Refused, match="pause mode 'sleep'"):
                refused.result(10)
            assert resume.result(10)["status"] == "ok"
            assert not engine.runner.paused
        finally:
            channel.close()


def test_continue_engines_reports_the_unreachable(engine):
    with EngineClient(KEY, timeout_s=10) as client:
        client.pause_generation(engine.url, "in_place")
    gone = f"http://127.0.0.1:{free_port()}"
    failed = continue_engines([gone, engine.url], KEY, timeout_s=5.0)
    assert list(failed) == [gone] and isinstance(failed[gone], httpx.ConnectError)
    assert not engine.runner.paused
    assert list(continue_engines([engine.url], "wrong", timeout_s=5.0)) == [engine.url]


def test_importing_the_package_and_the_client_loads_no_torch():
    code = (
        "import sys, weight_bus, weight_bus.engine_client, weight_bus.errors; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


INFO = b'{"tp_size": 1, "pp_size": 1}'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(INFO),
    INFO,
)


def test_a_probe_whose_connection_breaks_is_tried_once_more_on_a_new_one():
    """The bus drops an engine whose probe fails: a connection that breaks under a live engine gets one
    more try on a new connection, and the answer comes from it."""
    retries = metrics.PROBE_RETRIES._value.get()
    with scripted_server([None, ANSWER]) as (url, heads):
        with EngineClient(KEY, timeout_s=10) as client:
            assert client.server_info(url) == {"tp_size": 1, "pp_size": 1}
        assert len(heads) == 2 and all(h.startswith(b"GET /get_server_info") for h in heads)
    assert metrics.PROBE_RETRIES._value.get() == retries + 1
    with scripted_server([None, None]) as (url, heads):  # broken twice: the second error is raised
        with EngineClient(KEY, timeout_s=10) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                client.server_info(url)
        assert len(heads) == 2


def test_a_probe_that_times_out_is_not_repeated():
    with scripted_server([]) as (url, heads):  # holds every connection unanswered
        with EngineClient(KEY, timeout_s=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.server_info(url)
        assert len(heads) == 1
