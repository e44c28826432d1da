"""WeightBus (trainer side) against real built-in engines over HTTP + gloo: a publish swaps the weights of
every engine bit for bit (cast to the engine's dtype), tags the version, pauses only around the swap
(in-flight requests go on under the new weights, or are aborted), consumes the trainer's tensors lazily,
and never overlaps another publish."""

import threading
import time

import http_calls
import pytest
import torch
from bus_engines import AUTH, KEY, assert_holds, noisy_model, version

from generator_fleet.engine import EngineServer
from weight_bus import BusError, WeightBus, update_due

PROMPT = [1, 5, 6, 3, 7, 14]
CONTEXT_LENGTH = 4096  # room for a request still running when the publish lands (RoPE works past 64)
LONG = 400
"""max_new_tokens of a request in flight across a publish (hundreds of decode steps after it started)."""
DEADLINE_S = 60.0


def _greedy(url: str) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
    }
    r = http_calls.post(url + "/generate", json=body, headers=AUTH, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def engines(model_dir):
    servers = [EngineServer(str(model_dir), api_key=KEY, torch_threads=1).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def fresh_engine(model_dir):
    """An engine with room for long requests, whose weights a test may change."""
    server = EngineServer(
        str(model_dir),
        api_key=KEY,
        torch_threads=1,
        context_length=CONTEXT_LENGTH,
        kv_cache_tokens=2 * CONTEXT_LENGTH,
    ).start()
    yield server
    server.stop()


@pytest.mark.parametrize("bucket_bytes, seed", [(1 << 30, 2), (64 * 1024, 3)])  # one bucket; many buckets
def test_publish_swaps_weights_on_every_engine(engines, tmp_path, bucket_bytes, seed):
    servers = engines
    model_b = noisy_model(tmp_path / "b", seed)  # differs from whatever the engines hold now
    urls = [s.url for s in servers]
    before = [_greedy(u) for u in urls]
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=bucket_bytes)
    bus.connect()
    try:
        stats = bus.publish(model_b.named_parameters(), version=7)
        assert stats.version == 7 and stats.bytes == sum(p.numel() * 4 for p in model_b.parameters())
        assert stats.buckets >= (2 if bucket_bytes < 1 << 20 else 1)
        assert 0 < stats.transfer_ms <= stats.pause_ms and sorted(stats.engines) == sorted(urls)
        for s in servers:
            assert_holds(s, model_b)
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            for _ in range(8):
                ids = torch.cat([ids, model_b(ids).logits[:, -1:].argmax(-1)], dim=1)
        expected = ids[0, len(PROMPT) :].tolist()
        after = [_greedy(u) for u in urls]
        assert after == [expected, expected] and after != before
        for u in urls:
            assert version(u) == "7"
            info = http_calls.get(u + "/get_server_info", headers=AUTH).json()
            assert not info["internal_states"][0]["paused"]
    finally:
        bus.close()
    for s in servers:  # close() left the group on every engine
        assert http_calls.get(s.url + "/get_server_info", headers=AUTH).json()["weight_update_groups"] == []


def test_weights_are_cast_to_the_engine_dtype_and_gathered_lazily(model_dir, tmp_path):
    """A bf16 engine gets the fp32 trainer weights rounded to bf16, bit for bit; the bus asks for each
    tensor only when it packs it: the first one before the engines pause, the last while they are paused."""
    server = EngineServer(str(model_dir), api_key=KEY, torch_threads=1, dtype="bfloat16").start()
    model = noisy_model(tmp_path / "b", 4)
    params = list(model.named_parameters())
    paused_when_pulled = []

    def lazily():
        for name, p in params:
            paused_when_pulled.append(server.runner.paused)
            yield name, p

    bus = WeightBus([server.url], api_key=KEY, bucket_bytes=64 * 1024)
    bus.connect()
    try:
        stats = bus.publish(lazily(), version=3)
        assert stats.bytes == sum(p.numel() * 2 for _, p in params) and stats.buckets > 2
        assert_holds(server, model, dtype=torch.bfloat16)
        assert version(server.url) == "3"
        assert len(paused_when_pulled) == len(params)
        assert paused_when_pulled[0] is False and paused_when_pulled[-1] is True
    finally:
        bus.close()
        server.stop()


def _start_long_request(url: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True},
        }
        out["res"] = http_calls.post(url + "/generate", json=body, headers=AUTH, timeout=DEADLINE_S).json()

    th = threading.Thread(target=run)
    th.start()
    return th, out


def _once_generating(server, named):
    """Hand over `named`, but only once the engine has produced a few tokens of a running request: the
    bus pulls its first tensor before it pauses, so the pause lands in the middle of that request."""
    deadline = time.monotonic() + DEADLINE_S
    while server.runner.stats.generation_tokens_total < 3:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.002)  # poll interval: the token count decides
    yield from named


def test_in_place_pause_keeps_requests_and_later_tokens_carry_the_new_version(fresh_engine, tmp_path):
    model = noisy_model(tmp_path / "b", 5)
    bus = WeightBus([fresh_engine.url], api_key=KEY, pause_mode="in_place")
    bus.connect()
    try:
        th, out = _start_long_request(fresh_engine.url)
        stats = bus.publish(_once_generating(fresh_engine, model.named_parameters()), version=5)
        th.join(DEADLINE_S)
        meta = out["res"]["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(out["res"]["output_ids"]) == LONG
        [old, new] = meta["weight_versions"]
        assert old["version"] == "0" and new["version"] == "5"
        assert old["start"] == 0 and 3 <= old["end"] == new["start"] < new["end"] == LONG
        assert stats.pause_ms >= stats.transfer_ms > 0
        assert_holds(fresh_engine, model)
    finally:
        bus.close()


def test_abort_pause_returns_in_flight_requests_aborted(fresh_engine, tmp_path):
    model = noisy_model(tmp_path / "b", 6)
    bus = WeightBus([fresh_engine.url], api_key=KEY, pause_mode="abort")
    bus.connect()
    try:
        th, out = _start_long_request(fresh_engine.url)
        bus.publish(_once_generating(fresh_engine, model.named_parameters()), version=6)
        th.join(DEADLINE_S)
        meta = out["res"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 3 <= len(out["res"]["output_ids"]) < LONG
        assert meta["weight_version"] == "0"  # every token it has came from the old weights
        assert_holds(fresh_engine, model)
        assert _greedy(fresh_engine.url)  # and generation goes on
    finally:
        bus.close()


def test_publishes_never_overlap(engines, tmp_path):
    """A second publish (another thread) waits until the first has finished, even while the first is
    still gathering."""
    model_b, model_c = noisy_model(tmp_path / "b", 7), noisy_model(tmp_path / "c", 8)
    bus = WeightBus([s.url for s in engines], api_key=KEY, bucket_bytes=64 * 1024)
    bus.connect()
    release = threading.Event()
    events: list[str] = []

    def first():
        for i, (name, p) in enumerate(model_b.named_parameters()):
            if i == 3:
                events.append("first gathering")
                release.wait(DEADLINE_S)
            yield name, p
        events.append("first drained")

    def second():
        events.append("second started")
        yield from model_c.named_parameters()

    try:
        a = threading.Thread(target=bus.publish, args=(first(), 1))
        a.start()
        deadline = time.monotonic() + DEADLINE_S
        while "first gathering" not in events:
            assert time.monotonic() < deadline and a.is_alive(), "the first publish never started gathering"
            time.sleep(0.001)  # poll interval: the event list decides
        b = threading.Thread(target=bus.publish, args=(second(), 2))
        b.start()
        b.join(0.3)  # it has had time to start, had the lock not held it
        assert b.is_alive() and events == ["first gathering"]
        release.set()
        a.join(DEADLINE_S)
        b.join(DEADLINE_S)
        assert events == ["first gathering", "first drained", "second started"]
        for s in engines:
            assert_holds(s, model_c)
            assert version(s.url) == "2"
    finally:
        release.set()
        bus.close()


def test_unknown_parameter_fails_loudly_and_engines_keep_serving(engines):
    servers = engines
    urls = [s.url for s in servers]
    bus = WeightBus(urls, api_key=KEY, backend="gloo")
    bus.connect()
    try:
        with pytest.raises(BusError, match="unknown parameter"):
            bus.publish([("no.such.weight", torch.zeros(3))], version=99)
        assert all(len(_greedy(u)) == 8 for u in urls)  # continued after the failed swap
        assert all(version(u) != "99" for u in urls)
        assert all(
            not s.app.state.engine.receiver.broken for s in servers
        )  # the bytes arrived; only the load refused
    finally:
        bus.close()


def test_wrong_token_is_refused(engines):
    servers = engines
    bus = WeightBus([servers[0].url], api_key="wrong", backend="gloo", timeout_s=10)
    with pytest.raises(BusError, match="401"):
        bus.connect()
    bus.close()


def test_pause_modes():
    for mode in ("in_place", "retract", "abort"):
        WeightBus([], pause_mode=mode).close()
    with pytest.raises(ValueError, match="pause_mode"):
        WeightBus([], pause_mode="sleep")


def test_update_cadence_every_k_versions_and_always_the_last():
    assert [v for v in range(1, 11) if update_due(v, 3, final_version=10)] == [3, 6, 9, 10]
    assert [v for v in range(1, 5) if update_due(v, 1)] == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        update_due(1, 0)
