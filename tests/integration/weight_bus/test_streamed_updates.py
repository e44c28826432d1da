"""Streamed weight updates (weight_bus/stream.py) against real built-in engines over HTTP + gloo: after the
first update the bus sends each update as one call per engine, its buckets byte ranges of the engines'
weight arena received in place (or, without one, named buckets); bit for bit on several engines, cast to
the engine dtype, tied weights included, staged beside the serving weights on request, whole when the
engine answers whatever order its receives complete in, and an engine killed mid-stream is dropped while
the survivors are parked and made whole by the next update. The planning and packing are checked without
engines too, on a model of mixed dtypes."""

from __future__ import annotations

import signal

import http_calls
import pytest
import torch
from bus_engines import AUTH, KEY, EngineProcess, assert_holds, noisy_model, publish_bounded, version
from prometheus_client import REGISTRY

from generator_fleet.engine import EngineServer
from generator_fleet.engine.arena import lay_out
from weight_bus import BusError, WeightBus, receiver
from weight_bus.packing import pack
from weight_bus.registry import EngineRegistration, EngineRegistry
from weight_bus.schema import WeightLayout
from weight_bus.stream import arena_plan, named_plan, pack_arena

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    noisy_model(root / "a", 1)
    return root, [noisy_model(root / f"m{i}", 10 + i) for i in range(4)]


@pytest.fixture(scope="module")
def engines(models):
    root, _ = models
    servers = [EngineServer(str(root / "a"), api_key=KEY, torch_threads=1).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 96 * 1024])  # one bucket; many
def test_updates_after_the_first_stream_into_the_arena_bit_for_bit(engines, models, bucket_bytes):
    _, ms = models
    urls = [s.url for s in engines]
    layout = http_calls.get(urls[0] + "/weight_layout", headers=AUTH).json()
    info = http_calls.get(urls[0] + "/get_server_info", headers=AUTH).json()
    assert info["weight_layout"] == layout["digest"]
    names = [e[0] for e in layout["entries"]]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # tied: one range, two names
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=bucket_bytes)
    bus.connect()
    try:
        first = publish_bounded(bus, ms[0].named_parameters(), 1)
        assert first.stream == "" and first.paused  # what the trainer sends is learned from the first
        for v, m in enumerate(ms[1:3], start=2):
            phases = REGISTRY.get_sample_value(
                "slipstream_bus_publish_phase_seconds_count", {"phase": "transfer"}
            )
            stats = publish_bounded(bus, m.named_parameters(), v)
            assert stats.stream == "arena" and not stats.paused and stats.dropped == []
            # where its time went: the call goes before bucket 0 is packed, so bucket 0's phase is ~empty
            assert list(stats.phases_ms) == ["membership", "plan", "bucket0", "transfer", "after"]
            assert stats.phases_ms["transfer"] == pytest.approx(stats.transfer_ms, abs=1e-3)
            assert stats.phases_ms["bucket0"] < stats.phases_ms["transfer"]
            after = REGISTRY.get_sample_value(
                "slipstream_bus_publish_phase_seconds_count", {"phase": "transfer"}
            )
            assert after == (phases or 0) + 1
            assert stats.bytes == layout["nbytes"]  # the buckets cover the arena end to end
            assert stats.buckets == (1 if bucket_bytes > 1 << 20 else stats.buckets) and stats.buckets >= 1
            for s in engines:
                assert_holds(s, m)
                assert version(s.url) == str(v)
                assert not s.runner.paused
            rate = REGISTRY.get_sample_value("slipstream_bus_update_bytes_per_second", {"backend": "gloo"})
            assert rate == pytest.approx(stats.bytes / stats.transfer_s)
            wire = REGISTRY.get_sample_value("slipstream_bus_wire_bytes_per_second", {"backend": "gloo"})
            assert (wire is not None and wire > 0) or stats.buckets == 1
    finally:
        bus.close()


def test_streamed_updates_cast_to_a_bf16_engine_and_can_be_staged(models):
    """fp32 trainer weights land in a bf16 engine's arena rounded to bf16; staged, the engine allocates a
    second arena once and the update's pause is the swap the engine reports."""
    root, ms = models
    server = EngineServer(str(root / "a"), api_key=KEY, torch_threads=1, dtype="bfloat16").start()
    bus = WeightBus([server.url], api_key=KEY, bucket_bytes=64 * 1024, stage=True)
    bus.connect()
    try:
        publish_bounded(bus, ms[0].named_parameters(), 1)
        for v in (2, 3):
            stats = publish_bounded(bus, ms[v].named_parameters(), v)
            assert stats.stream == "arena" and stats.staged
            assert_holds(server, ms[v], dtype=torch.bfloat16)
            assert version(server.url) == str(v)
        assert server.runner._staging is not None
        assert server.runner._staging.numel() == server.runner.fwd.arena.buffer.numel()
    finally:
        bus.close()
        server.stop()


class LandsWhenSeen:
    """A receive whose bytes reach their destination only once the receiver sees it complete: all that a
    collective promises (its output is defined after is_completed() or wait()), and what gloo does when a
    worker thread begins an earlier bucket after the last one is already in."""

    def __init__(self, work, scratch: torch.Tensor, dest: torch.Tensor) -> None:
        self.work, self.scratch, self.dest = work, scratch, dest

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:
            self._land()
        return done

    def wait(self) -> bool:
        self.work.wait()
        self._land()
        return True

    def _land(self) -> None:
        if self.scratch is not None:
            self.dest.copy_(self.scratch)
            self.scratch = None


@pytest.mark.parametrize("stage", [True, False])
def test_a_streamed_update_is_whole_when_the_engine_answers_whatever_order_buckets_land(
    engines, models, monkeypatch, stage
):
    """The last bucket's receive completing says nothing of the others (gloo runs a group's collectives
    on two threads): the engine waits for every one, so the staging arena it swaps in, or the weights it
    received into in place, hold the whole update when it answers."""
    _, ms = models
    real = receiver.broadcast_async

    def lands_when_seen(group, dest, src=0):
        scratch = torch.empty_like(dest)
        return LandsWhenSeen(real(group, scratch, src), scratch, dest)

    monkeypatch.setattr(receiver, "broadcast_async", lands_when_seen)
    server = engines[0]
    bus = WeightBus([server.url], api_key=KEY, bucket_bytes=64 * 1024, stage=stage)
    bus.connect()
    try:
        publish_bounded(bus, ms[0].named_parameters(), 1)
        stats = publish_bounded(bus, ms[3].named_parameters(), 2)
        assert stats.stream == "arena" and stats.staged == stage and stats.buckets > 2
        assert_holds(server, ms[3])
        assert version(server.url) == "2"
    finally:
        bus.close()


def test_engine_killed_mid_stream_is_dropped_and_survivors_are_made_whole_next_time(models, tmp_path):
    root, ms = models
    victim = EngineProcess(root / "a", tmp_path / "victim.log")
    survivor = EngineServer(str(root / "a"), api_key=KEY, torch_threads=1).start()
    bus = WeightBus([survivor.url, victim.url], api_key=KEY, bucket_bytes=96 * 1024, timeout_s=TIMEOUT_S)
    bus.connect()
    try:
        publish_bounded(bus, ms[0].named_parameters(), 1)
        n = len(list(ms[1].parameters()))

        def killing():
            for i, (name, p) in enumerate(ms[1].named_parameters()):
                if i == n // 2:
                    victim.kill(signal.SIGKILL)
                yield name, p

        stats = publish_bounded(bus, killing(), 2)
        assert stats.stream == "arena" and victim.url in stats.dropped
        if survivor.url in stats.dropped:  # parked: its weights are part new, so it generates nothing
            assert survivor.runner.paused and version(survivor.url) == "1"
        stats = publish_bounded(bus, ms[2].named_parameters(), 3)
        assert stats.engines == [survivor.url]
        assert_holds(survivor, ms[2])
        assert version(survivor.url) == "3" and not survivor.runner.paused
    finally:
        bus.close()
        survivor.stop()
        victim.kill()


def test_trainer_tensors_that_leave_the_plan_fail_the_update_and_the_next_one_makes_engines_whole(
    engines, models
):
    """The stream is announced before bucket 0 is packed, so the engines are already receiving when the
    trainer's tensors turn out not to be the plan's (a tensor missing, or one the engines lack): the
    update fails with the cause, the engines that may hold part of it stay paused, and the next update
    (bucket by bucket, what the trainer sends learned anew) makes every engine whole and generating."""
    _, ms = models
    urls = [s.url for s in engines]
    bus = WeightBus(urls, api_key=KEY, bucket_bytes=96 * 1024, timeout_s=TIMEOUT_S)
    bus.connect()
    try:
        publish_bounded(bus, ms[0].named_parameters(), 1)
        assert publish_bounded(bus, ms[1].named_parameters(), 2).stream == "arena"
        named = list(ms[2].named_parameters())
        v = 2
        for bad in (named[:-1], [("not.a.weight", torch.zeros(2)), *named]):
            with pytest.raises(BusError, match="plan"):
                publish_bounded(bus, iter(bad), v + 1)
            stats = publish_bounded(bus, ms[3].named_parameters(), v + 2)
            assert stats.stream == "" and sorted(stats.engines) == sorted(urls)
            for s in engines:
                assert_holds(s, ms[3])
                assert version(s.url) == str(v + 2) and not s.runner.paused
            assert publish_bounded(bus, ms[1].named_parameters(), v + 3).stream == "arena"
            v += 3
    finally:
        bus.close()


def test_streamed_updates_skip_the_probe_yet_drop_an_engine_that_died_or_left_between_them(
    models, tmp_path, redis_client, job_id
):
    """After a streamed update that reached every engine the next one is sent unprobed: an engine killed
    since fails the stream's own call and is dropped there (the survivor is made whole by the update
    after), and one that left the registry (scaled down) is dropped before anything is sent, so that
    update reaches the others whole."""
    root, ms = models
    victim = EngineProcess(root / "a", tmp_path / "victim.log")
    leaver = EngineServer(str(root / "a"), api_key=KEY, torch_threads=1).start()
    survivor = EngineServer(str(root / "a"), api_key=KEY, torch_threads=1).start()
    urls = [survivor.url, leaver.url, victim.url]
    regs = {u: EngineRegistration(redis_client, job_id, u) for u in urls}
    bus = WeightBus(
        urls, api_key=KEY, bucket_bytes=96 * 1024, timeout_s=TIMEOUT_S,
        registry=EngineRegistry(redis_client, job_id),
    )  # fmt: skip
    bus.connect()
    try:
        publish_bounded(bus, ms[0].named_parameters(), 1)
        stats = publish_bounded(bus, ms[1].named_parameters(), 2)
        assert stats.stream == "arena" and stats.probed and sorted(stats.engines) == sorted(urls)
        regs.pop(leaver.url).close()  # scaled down: it leaves the registry, then its process ends
        leaver.stop()
        stats = publish_bounded(bus, ms[2].named_parameters(), 3)
        assert not stats.probed and stats.dropped == [leaver.url] and stats.stream == "arena"
        assert_holds(survivor, ms[2])
        assert version(survivor.url) == version(victim.url) == "3"
        assert publish_bounded(bus, ms[3].named_parameters(), 4).probed  # the one after a drop probes
        victim.kill(signal.SIGKILL)
        stats = publish_bounded(bus, ms[1].named_parameters(), 5)
        assert not stats.probed and victim.url in stats.dropped
        stats = publish_bounded(bus, ms[0].named_parameters(), 6)
        assert stats.probed and stats.engines == [survivor.url]
        assert_holds(survivor, ms[0])
        assert version(survivor.url) == "6" and not survivor.runner.paused
        assert not publish_bounded(bus, ms[1].named_parameters(), 7).probed
        # parked and rejoined before its renewal moved it to the joining set: promoted once it is there
        regs[survivor.url].renew()
        publish_bounded(bus, ms[2].named_parameters(), 8)
        assert EngineRegistry(redis_client, job_id).live() == [survivor.url]
    finally:
        bus.close()
        for r in regs.values():
            r.close()
        survivor.stop()
        victim.kill()


class Mixed(torch.nn.Module):
    """Parameters and a buffer of three dtypes, one pair fused into a block, one tensor tied."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(5, 3))
        self.b = torch.nn.Parameter(torch.randn(7, 3))
        self.h = torch.nn.Parameter(torch.randn(9, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.arange(3, dtype=torch.int64))
        self.tied = self.a


def test_planned_buckets_are_the_arena_bytes_for_mixed_dtypes_and_fused_blocks():
    """lay_out puts every tensor in one aligned arena (a and b adjacent: the fused block), and packing the
    trainer's tensors by the arena plan gives exactly the bytes an engine's arena must hold, whatever the
    bucket size and the order the trainer sends them in."""
    engine = Mixed()
    arena = lay_out(engine, [[engine.a, engine.b]])
    assert arena is not None and arena.fused[0].shape == (12, 3)
    assert engine.a.data_ptr() == arena.buffer.data_ptr()  # a is the arena's first block
    assert engine.b.data_ptr() == engine.a.data_ptr() + 5 * 3 * 4  # b right after a: one fused GEMM weight
    assert all(e.offset % 256 == 0 for e in arena.layout.entries if e.name in ("h", "steps"))
    layout = WeightLayout(
        nbytes=arena.layout.nbytes, entries=arena.layout.entries, digest=arena.layout.digest
    )
    trainer = {  # fp32 everywhere: the plan casts to the engine's dtypes
        "steps": torch.tensor([7, 8, 9]),
        "h": torch.randn(9),
        "b": torch.randn(7, 3),
        "a": torch.randn(5, 3),
    }
    sent = [(n, tuple(t.shape), t.dtype) for n, t in trainer.items()]
    for bucket_bytes in (1 << 20, 64):
        plan = arena_plan(layout, sent, bucket_bytes)
        assert not isinstance(plan, str), plan
        assert sum(b.nbytes for b in plan.buckets) == layout.nbytes
        got = torch.empty(layout.nbytes, dtype=torch.uint8)
        for b in pack_arena(plan, iter(trainer.items()), torch.device("cpu"), 2):
            spec = plan.buckets[b.index]
            got[spec.offset : spec.offset + spec.nbytes] = b.flat
        target = Mixed()
        lay_out(target, [[target.a, target.b]]).buffer.copy_(got)  # what the engine's receive does
        assert torch.equal(target.a, trainer["a"]) and torch.equal(target.b, trainer["b"])
        assert torch.equal(target.h, trainer["h"].to(torch.bfloat16))
        assert torch.equal(target.steps, trainer["steps"]) and target.tied is target.a


def test_a_plan_is_refused_when_the_trainer_does_not_fill_the_arena():
    engine = Mixed()
    layout = lay_out(engine, []).layout
    full = [("a", (5, 3), torch.float32), ("b", (7, 3), torch.float32), ("h", (9,), torch.float32)]
    full.append(("steps", (3,), torch.int64))
    assert "'b'" in arena_plan(layout, full[:1] + full[2:], 1 << 20)  # b is sent by nobody
    assert "shape" in arena_plan(layout, [("a", (3, 5), torch.float32), *full[1:]], 1 << 20)
    assert "no weight" in arena_plan(layout, [*full, ("extra", (1,), torch.float32)], 1 << 20)
    plan = named_plan(full, 100, torch.bfloat16)  # the named fallback is packing.pack's buckets
    tensors = ((n, torch.zeros(s, dtype=d)) for n, s, d in full)
    packed = list(pack(tensors, 100, torch.bfloat16, torch.device("cpu")))
    assert [b.names for b in plan.buckets] == [b.names for b in packed] == [["a", "b", "h"], ["steps"]]
    assert [b.nbytes for b in plan.buckets] == [b.nbytes for b in packed]
    assert plan.buckets[1].dtypes == ["int64"] and plan.buckets[0].dtypes == ["bfloat16"] * 3


def test_a_streamed_update_refused_before_any_byte_leaves_the_engine_generating(engines):
    """No such group, or a layout that is not the engine's: refused before anything is received, so the
    serving weights are whole and generation goes on (only a receive that wrote them pauses the engine)."""
    url = engines[0].url
    layout = http_calls.get(url + "/weight_layout", headers=AUTH).json()
    for group, digest in (("no-such-group", layout["digest"]), ("no-such-group", "not-this-layout")):
        body = {
            "names": [], "dtypes": [], "shapes": [], "group_name": group, "layout": digest,
            "stream": [{"offset": 0, "nbytes": layout["nbytes"]}], "weight_version": "99",
        }  # fmt: skip
        r = http_calls.post(url + "/update_weights_from_distributed", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400 and not r.json()["success"]
        assert not engines[0].runner.paused and version(url) != "99"
        assert http_calls.get(url + "/health_generate", headers=AUTH, timeout=30).status_code == 200
