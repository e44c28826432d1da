"""The steady-state IPC handoff on CPU, with real engine processes: the trainer's own tensors (already in
the wire dtype) go as one direct payload of per-tensor handles, with no pause and no probe once the
engines are known alive; the payload is serialized once and each engine loads a repeat from the tensors
it mapped the first time (no unpickling); the mappings are dropped when the trainer's tensors change
(reallocated, a new trainer process), an engine that joins opens the kept payload afresh, and a dead
engine is found by the update's own call."""

from __future__ import annotations

import gc
import os

import http_calls
import pytest
import torch
from bus_engines import KEY, noisy_model, version
from metrics_text import sample
from test_ipc import IpcEngine

from weight_bus import WeightBus


@pytest.fixture
def engines(model_dir, tmp_path):
    procs = [IpcEngine(model_dir, tmp_path) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()


def _payloads(url: str, how: str) -> float:
    """How many payloads the engine had `how`; "repeat": kept (the same text again) or ref (a reference
    to a payload it keeps, which the bus sends a built-in engine in the payload's place)."""
    if how == "repeat":
        return _payloads(url, "kept") + _payloads(url, "ref")
    text = http_calls.get(url + "/metrics").text
    return sample(text, "slipstream_engine_ipc_payloads_total", how=how) or 0.0


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def _holds_exactly(engine: IpcEngine, expected: dict[str, torch.Tensor]) -> None:
    got = engine.weights()
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


class Joining:
    """A registry whose joining set the test fills (weight_bus.membership.Registry)."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.promoted: list[str] = []

    def joining(self) -> list[str]:
        return list(self.waiting)

    def promote(self, url: str) -> bool:
        self.waiting.remove(url)
        self.promoted.append(url)
        return True

    def demote(self, url: str) -> None:
        pass


def test_direct_handoff_kept_payload_and_reallocation(engines, tmp_path):
    """Persistent float32 tensors (the CPU engine's dtype) go direct, in one call, with no pause; the next
    update sends the same payload, which each engine loads from what it kept; new tensors (a
    reallocation) are a new payload, and the old tensors' shared memory is closed on every side once
    that update ends."""
    a, b = engines
    earlier = _shm_files()  # other tests' files in this process are not this test's to check
    named = {n: t.detach().clone() for n, t in noisy_model(tmp_path / "m", 3).state_dict().items()}
    bus = WeightBus([a.url], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        s1 = bus.publish(named.items(), version=1, persistent=True)
        assert (s1.handoff, s1.buckets, s1.paused) == ("direct", 1, False)
        assert s1.bytes == sum(t.numel() * 4 for t in named.values())
        _holds_exactly(a, named)
        payload = bus.transfer.direct.payload
        opened, refs = _payloads(a.url, "opened"), _payloads(a.url, "ref")
        torch._foreach_mul_(list(named.values()), -0.5)  # in place: the same storages
        s2 = bus.publish(named.items(), version=2, persistent=True)
        assert (s2.handoff, s2.paused, s2.probed) == ("direct", False, False)
        assert bus.transfer.direct.payload is payload  # serialized once
        # sent as the reference the engine answered the first time, loaded from what it kept
        assert _payloads(a.url, "ref") == refs + 1 and _payloads(a.url, "opened") == opened
        _holds_exactly(a, named)
        assert version(a.url) == "2"

        # A reallocation: new tensors, new payload; the old storages' files go once the update ends.
        old_files = _shm_files() - earlier
        named = {n: t.clone() + 1 for n, t in named.items()}
        gc.collect()
        assert old_files <= _shm_files()  # the engine still maps the old storages
        s3 = bus.publish(named.items(), version=3, persistent=True)
        assert s3.handoff == "direct" and bus.transfer.direct.payload != payload
        assert _payloads(a.url, "opened") == opened + 1
        _holds_exactly(a, named)
        left = old_files & _shm_files()
        assert not left, f"{len(left)} of {len(old_files)}"  # closed by the engine, unlinked

        # An engine that joins gets the kept payload and opens it; the first one loads it as kept.
        registry = Joining()
        bus.members.registry = registry
        registry.waiting.append(b.url)
        kept_a = _payloads(a.url, "repeat")
        s4 = bus.publish(named.items(), version=4, persistent=True)
        assert s4.joined == [b.url] and sorted(s4.engines) == sorted([a.url, b.url])
        assert _payloads(a.url, "repeat") == kept_a + 1 and _payloads(b.url, "opened") == 1
        for e in (a, b):
            _holds_exactly(e, named)
            assert version(e.url) == "4"
    finally:
        bus.close()

    # Another bus over the same tensors serializes anew; on CPU a payload names shared-memory files
    # (unique per allocation) only, so it is the same text and the engines keep loading it as kept; new
    # tensors of a restarted trainer are new files, as in the reallocation above.
    bus = WeightBus([a.url, b.url], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        torch._foreach_add_(list(named.values()), 0.125)
        kept = _payloads(a.url, "kept")
        bus.publish(named.items(), version=5, persistent=True)  # a new bus knows no reference: the text
        assert _payloads(a.url, "kept") == kept + 1
        for e in (a, b):
            _holds_exactly(e, named)
    finally:
        bus.close()


def test_not_persistent_or_other_dtype_goes_through_the_ring(engines, tmp_path):
    """Tensors that are not the trainer's own, or need a cast, are packed into the ring: several buckets
    are paused and continued; one bucket to built-in engines folds the pause."""
    a, _ = engines
    named = {n: t.detach().clone() for n, t in noisy_model(tmp_path / "m", 4).state_dict().items()}
    bus = WeightBus([a.url], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        s = bus.publish(named.items(), version=1)
        assert (s.handoff, s.paused) == ("ring", True) and s.buckets == len(named)
        half = {n: t.to(torch.bfloat16) for n, t in named.items()}
        s = bus.publish(half.items(), version=2, persistent=True)  # the engine's dtype is float32
        assert s.handoff == "ring"
        _holds_exactly(a, {n: t.float() for n, t in half.items()})
    finally:
        bus.close()
    bus = WeightBus([a.url], api_key=KEY, backend="ipc", bucket_bytes=1 << 30, pause_mode="abort")
    bus.connect()
    try:
        for v in (3, 4):
            s = bus.publish(named.items(), version=v)
            assert (s.handoff, s.buckets, s.paused) == ("ring", 1, False)
        _holds_exactly(a, named)
        assert _payloads(a.url, "repeat") >= 1  # the slot's payload, repeated
    finally:
        bus.close()


def test_dead_engine_is_found_by_the_call(engines, tmp_path):
    """No probe while every engine answered the last update: an engine that died since fails the update's
    call and is dropped, the other gets the update, and the next update probes again."""
    a, b = engines
    named = {n: t.detach().clone() for n, t in noisy_model(tmp_path / "m", 5).state_dict().items()}
    bus = WeightBus([a.url, b.url], api_key=KEY, backend="ipc", timeout_s=20.0)
    bus.connect()
    try:
        bus.publish(named.items(), version=1, persistent=True)
        b.kill()
        s = bus.publish(named.items(), version=2, persistent=True)
        assert not s.probed and s.dropped == [b.url] and s.engines == [a.url]
        assert version(a.url) == "2"
        s = bus.publish(named.items(), version=3, persistent=True)
        assert s.probed and s.engines == [a.url]
        _holds_exactly(a, named)
    finally:
        bus.close()
