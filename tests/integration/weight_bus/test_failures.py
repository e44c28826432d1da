"""Engines that fail during a weight update, and engines that join mid-job, against real built-in engines
over HTTP + gloo. An engine SIGKILLed before the first bucket or between broadcasts, or one that hangs
(SIGSTOP), is dropped (after a failed update, one that answers no probe is not waited for); the group is
rebuilt over the survivors and the same update still reaches them, bit for bit; publish returns. An
engine that registers mid-job gets the current weights before the registry shows it to rollout workers."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import http_calls
import httpx
import pytest
from bus_engines import KEY, EngineProcess, assert_holds, noisy_model, publish_bounded, version
from metrics_text import sample

from generator_fleet.engine import EngineServer
from weight_bus import WeightBus
from weight_bus.registry import EngineRegistration, EngineRegistry, engines_key

TIMEOUT_S = 2.0
"""The bus's bound on calls and collectives; survivors give up a receive stuck on the dead peer after it."""
BUCKET_BYTES = 128 * 1024
"""The tiny model (2.1 MB in fp32) travels in ~17 buckets: a kill can land between broadcasts."""
HANG_LIMIT_S = 120.0
"""Only so that a regression fails instead of hanging the suite (recovery takes a few TIMEOUT_S)."""


class Models:
    def __init__(self, root) -> None:
        self.path_a = root / "a"  # what the engines load
        noisy_model(self.path_a, 1)
        self.b = noisy_model(root / "b", 2)
        self.c = noisy_model(root / "c", 3)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("bus-failures"))


@pytest.fixture(scope="module")
def victims(models, tmp_path_factory):
    """Engine processes started side by side (each test kills or stops one)."""
    logs = tmp_path_factory.mktemp("engine-logs")
    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(lambda i: EngineProcess(models.path_a, logs / f"engine-{i}.log"), range(6)))
    yield procs
    for p in procs:
        p.kill()


@pytest.fixture(scope="module")
def survivor(models):
    server = EngineServer(str(models.path_a), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def live(redis_client, job: str) -> list[str]:
    sec, usec = redis_client.time()
    now_ms = sec * 1000 + usec // 1000
    return sorted(u.decode() for u in redis_client.zrangebyscore(engines_key(job), now_ms, "+inf"))


def killing_at(model, index: int, victim: EngineProcess, sig: int = signal.SIGKILL):
    """model's parameters, lazily; `victim` gets `sig` just before tensor `index` is handed over (for
    index > 0 the buckets before it are announced and on the wire by then)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if i == index:
            victim.kill(sig)
        yield name, p


def test_engine_killed_before_the_first_bucket(models, survivor, victims):
    victim = victims[0]
    bus = WeightBus([survivor.url, victim.url], api_key=KEY, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
    bus.connect()
    try:
        # it answered the bus's probe, then dies while the first bucket is gathered (before the pause)
        stats = publish_bounded(bus, killing_at(models.b, 0, victim), version=5)
        assert stats.dropped == [victim.url] and stats.engines == [survivor.url]
        assert_holds(survivor, models.b)
        assert version(survivor.url) == "5"

        stats = publish_bounded(bus, models.c.named_parameters(), version=6)
        assert stats.engines == [survivor.url] and stats.dropped == [] and stats.rebuilds == 0
        assert_holds(survivor, models.c)
    finally:
        bus.close()


def test_engine_killed_between_broadcasts_is_demoted_and_not_rejoined(
    models, survivor, victims, redis_client, job_id
):
    victim = victims[1]
    registrations = [EngineRegistration(redis_client, job_id, u) for u in (survivor.url, victim.url)]
    registry = EngineRegistry(redis_client, job_id)
    bus = WeightBus(
        [survivor.url, victim.url],
        api_key=KEY,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=TIMEOUT_S,
        registry=registry,
    )
    bus.connect()
    try:
        n = len(list(models.c.parameters()))
        stats = publish_bounded(bus, killing_at(models.c, n // 2, victim), version=7)
        assert stats.buckets > 4  # it died with buckets confirmed and others in flight
        assert stats.dropped == [victim.url] and stats.engines == [survivor.url] and stats.rebuilds >= 1
        assert_holds(survivor, models.c)
        assert version(survivor.url) == "7"
        assert live(redis_client, job_id) == [survivor.url]  # rollouts stop going to it at once

        registrations[1].renew()  # its lease goes on (it lives here): it waits as a joiner ...
        assert registry.joining() == [victim.url]
        stats = publish_bounded(bus, models.b.named_parameters(), version=8)
        assert stats.joined == [] and stats.engines == [survivor.url]  # ... but is not retried yet
        assert_holds(survivor, models.b)
    finally:
        bus.close()
        for r in registrations:
            r.close()


def test_engine_that_left_the_registry_is_dropped_without_a_warning(
    models, survivor, victims, redis_client, job_id, caplog
):
    """Scaling down: the driver deregisters an engine, then stops it; the next update drops it quietly."""
    victim = victims[4]
    registrations = [EngineRegistration(redis_client, job_id, u) for u in (survivor.url, victim.url)]
    bus = WeightBus(
        [survivor.url, victim.url],
        api_key=KEY,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=TIMEOUT_S,
        registry=EngineRegistry(redis_client, job_id),
    )
    bus.connect()
    try:
        publish_bounded(bus, models.b.named_parameters(), version=1)
        registrations[1].close()
        victim.kill(signal.SIGKILL)
        with caplog.at_level(logging.INFO, logger="weight_bus"):
            stats = publish_bounded(bus, models.c.named_parameters(), version=2)
        assert stats.dropped == [victim.url] and stats.engines == [survivor.url]
        assert_holds(survivor, models.c)
        about = [r for r in caplog.records if victim.url in r.getMessage()]
        assert any("left the registry" in r.getMessage() for r in about), about
        assert not [r for r in about if r.levelno >= logging.WARNING], about
    finally:
        bus.close()
        registrations[0].close()


def test_engine_that_hangs_mid_update_is_dropped_after_the_timeout(models, survivor, victims):
    victim = victims[2]
    bus = WeightBus([survivor.url, victim.url], api_key=KEY, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
    bus.connect()
    try:
        n = len(list(models.b.parameters()))
        stats = publish_bounded(bus, killing_at(models.b, n // 2, victim, signal.SIGSTOP), version=9)
        assert stats.dropped == [victim.url] and stats.engines == [survivor.url]
        assert_holds(survivor, models.b)
        assert version(survivor.url) == "9"
    finally:
        bus.close()
        victim.kill()


def test_after_a_failed_update_an_engine_that_answers_no_probe_is_not_waited_for(survivor, victims):
    """Telling the dead from the alive after a failed update (Transfer.settle): each engine's call to the
    update is waited for (bounded: timeout_s + 2 grace), but one that is silent and answers no probe
    either (a stopped process, as a streamed update's broadcast that never completes leaves it) is lost
    on the probe's error at once; a live engine that answers late is still waited for."""
    victim = victims[5]
    bus = WeightBus([survivor.url, victim.url], api_key=KEY, timeout_s=TIMEOUT_S)
    bus.connect()
    try:
        victim.kill(signal.SIGSTOP)
        late, never = Future(), Future()  # the survivor's answer comes late; the stopped engine's never
        threading.Timer(0.5, late.set_result, [{}]).start()
        errors: dict[str, BaseException] = {}
        bus.transfer.settle({survivor.url: [late], victim.url: [never]}, errors)
        assert late.done() and list(errors) == [victim.url], errors
        assert isinstance(errors[victim.url], httpx.TimeoutException), repr(errors[victim.url])
    finally:
        bus.close()
        victim.kill()


def test_without_in_stream_repair_survivors_stay_paused_until_the_next_update(models, victims, tmp_path):
    """The NCCL policy, here over gloo: after a failure mid-update the survivors are not patched (NCCL
    cannot tell which buckets reached them); they stay paused, out of the group, and the next update
    gives them the whole model and lets them go on."""
    victim = victims[3]
    survivor = EngineServer(str(models.path_a), api_key=KEY, torch_threads=1).start()
    bus = WeightBus(
        [survivor.url, victim.url],
        api_key=KEY,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=TIMEOUT_S,
        repair_in_stream=False,
    )
    bus.connect()
    try:
        n = len(list(models.b.parameters()))
        stats = publish_bounded(bus, killing_at(models.b, n // 2, victim), version=13)
        assert stats.engines == [] and sorted(stats.dropped) == sorted([survivor.url, victim.url])
        assert survivor.runner.paused and version(survivor.url) == "0"  # parked: nothing half-new runs

        stats = publish_bounded(bus, models.c.named_parameters(), version=14)
        assert stats.joined == [survivor.url] and stats.engines == [survivor.url]
        assert_holds(survivor, models.c)
        assert version(survivor.url) == "14" and not survivor.runner.paused
    finally:
        bus.close()
        survivor.stop()


def test_engine_registered_mid_job_gets_current_weights_before_traffic(
    models, survivor, redis_client, job_id
):
    late = EngineServer(str(models.path_a), api_key=KEY, torch_threads=1).start()
    first = EngineRegistration(redis_client, job_id, survivor.url)  # at job start: live at once
    registry = EngineRegistry(redis_client, job_id)
    bus = WeightBus([survivor.url], api_key=KEY, timeout_s=TIMEOUT_S, registry=registry)
    bus.connect()
    try:
        publish_bounded(bus, models.b.named_parameters(), version=11)
        joining = EngineRegistration(redis_client, job_id, late.url, joining=True)
        assert live(redis_client, job_id) == [survivor.url]  # rollout workers do not see it yet
        assert registry.joining() == [late.url] and version(late.url) == "0"
        assert bus.joiners_waiting() == [late.url]  # what a trainer with no batch publishes early for

        stats = publish_bounded(bus, models.c.named_parameters(), version=12)
        assert stats.joined == [late.url] and sorted(stats.engines) == sorted([survivor.url, late.url])
        assert bus.joiners_waiting() == []
        for server in (survivor, late):
            assert_holds(server, models.c)
            assert version(server.url) == "12"
        assert live(redis_client, job_id) == sorted([survivor.url, late.url]) and registry.joining() == []
        joining.renew()  # promoted for good: its renewals keep it live
        assert live(redis_client, job_id) == sorted([survivor.url, late.url])
    finally:
        bus.close()
        first.close()
        late.stop()


def test_engine_whose_sender_vanished_mid_update_stops_on_sigterm(models, tmp_path):
    """The trainer announced a bucket and never sent it (it died, or hangs): the engine's receive is blocked
    until the group's timeout (here 10 minutes). SIGTERM must still stop the engine process now, not when
    that receive gives up; the announcement gets an error answer."""
    engine = EngineProcess(models.path_a, tmp_path / "engine.log")
    bus = WeightBus([engine.url], backend="gloo", api_key=KEY, timeout_s=600.0)
    try:
        bus.connect()
        publish_bounded(bus, models.b.named_parameters(), 1)
        name, p = next(iter(models.b.named_parameters()))
        body = {
            "names": [name],
            "dtypes": ["float32"],
            "shapes": [list(p.shape)],
            "group_name": bus.members.name,
        }
        answer: dict = {}

        def announce() -> None:  # the bucket whose bytes never come
            try:
                answer["status"] = http_calls.post(
                    f"{engine.url}/update_weights_from_distributed",
                    json=body,
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=HANG_LIMIT_S,
                ).status_code
            except httpx.HTTPError as e:
                answer["error"] = e

        handled = _buckets_handled(engine.url)
        th = threading.Thread(target=announce, daemon=True)
        th.start()
        deadline = time.monotonic() + HANG_LIMIT_S
        while _buckets_handled(engine.url) == handled:  # the handler took the bucket: its receive waits
            assert time.monotonic() < deadline, "the engine never took the announcement"
            time.sleep(0.05)
        os.kill(engine.proc.pid, signal.SIGTERM)
        assert engine.wait(HANG_LIMIT_S) == 0  # a regression waits out the 600 s group timeout
        th.join(HANG_LIMIT_S)
        assert answer.get("status", 500) >= 500 or "error" in answer, answer
    finally:
        engine.kill()
        bus.close()


def _buckets_handled(url: str) -> float:
    """Buckets whose handler got the weight lock (the `wait` phase is observed then, before the receive)."""
    text = http_calls.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return sample(text, "slipstream_engine_weight_bucket_seconds_count", phase="wait") or 0.0
