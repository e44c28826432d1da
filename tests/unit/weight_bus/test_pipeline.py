"""HTTP/1.1 pipelining to a real built-in engine: requests written back to back on one connection are
answered in order; an idle connection is replaced; a dead engine fails every unanswered request."""

import json

import pytest
from bus_engines import AUTH, KEY, noisy_model

import weight_bus.pipeline as pipeline
from common.net import free_port
from generator_fleet.engine import EngineServer
from weight_bus.pipeline import Pipeline


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "a"
    noisy_model(path, 1)
    server = EngineServer(str(path), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def test_answers_come_back_in_order(engine, monkeypatch):
    channel = Pipeline(engine.url, AUTH, 5.0)
    try:
        futures = [
            channel.post("/pause_generation", b'{"mode": "in_place"}'),
            channel.post("/update_weight_version", json.dumps({"new_version": "41"}).encode()),
            channel.post("/update_weight_version", json.dumps({"new_version": "42"}).encode()),
            channel.post("/no_such_route", b"{}"),
            channel.post("/continue_generation", b"{}"),
        ]
        answers = [f.result(timeout=30) for f in futures]
        assert [a.status for a in answers] == [200, 200, 200, 404, 200]
        assert [json.loads(a.body).get("new_version") for a in answers[1:3]] == ["41", "42"]
        assert engine.runner.weight_version == "42" and not engine.runner.paused

        monkeypatch.setattr(pipeline, "IDLE_RECONNECT_S", 0.0)  # every request after a pause reconnects
        assert (
            channel.post("/update_weight_version", b'{"new_version": "0"}').result(timeout=30).status == 200
        )
    finally:
        channel.close()


def test_unreachable_engine_fails_every_request():
    channel = Pipeline(f"http://127.0.0.1:{free_port()}", AUTH, 5.0)
    with pytest.raises(ConnectionError):
        channel.post("/continue_generation", b"{}").result(timeout=30)
    channel.close()
