"""The per-rank colocated handoff on CPU with real processes: two trainer ranks in a gloo group (the
trainer's own RankGroup), each with its own bus, and two built-in engine processes; every rank hands the
weights to its own engine (engine j to rank j mod 2 on CPU), rank 0 pauses and continues them. The ranks
publish different tensors here, so each engine must hold exactly its own rank's tensors, bit for bit,
and the version, after a ring update (several buckets, paused) and a direct one (one call, folded)."""

from __future__ import annotations

import time
import traceback

import torch
from bus_engines import KEY, version
from rank_runs import rank_context
from test_ipc import IpcEngine

from common.net import free_port
from weight_bus import WeightBus, ipc
from weight_bus.membership import Member
from weight_bus.rank_handoff import assign


def rank_tensors(model_dir, rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank `rank` publishes at `step`: the engines' model, changed per rank and step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: t.detach().clone() * (1 + rank) + step for n, t in model.state_dict().items()}


def rank_main(rank: int, port: int, urls: list[str], model_dir, out, go) -> None:
    try:
        from trainer.distributed import DistInfo, RankGroup

        pool = RankGroup(DistInfo(rank, 2, "127.0.0.1", port), torch.device("cpu"))
        bus = WeightBus(urls if rank == 0 else [], api_key=KEY, backend="ipc", bucket_bytes=4096)
        bus.connect()
        stats = []
        named = rank_tensors(model_dir, rank, 1)
        s = bus.publish(named.items(), version=1, ranks=pool)  # gathered copies: the ring, paused
        stats.append(None if s is None else (s.handoff, s.paused, s.buckets, sorted(s.engines), s.ranks))
        pool.barrier()  # the test reads the engines here
        out.put(("published", rank, 1))
        go.wait(300)  # the test read the engines
        pool.barrier()
        named2 = rank_tensors(model_dir, rank, 2)
        for v in (2, 3):  # the rank's own tensors: direct, folded; the second time kept by the engine
            s = bus.publish(named2.items(), version=v, persistent=True, ranks=pool)
            stats.append(None if s is None else (s.handoff, s.paused, s.buckets, sorted(s.engines), s.ranks))
        pool.barrier()
        out.put(("done", rank, stats))
        bus.close()
        pool.close()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def test_assign_by_device_uuid_else_position():
    class E(Member):
        def __init__(self, url, uuid):
            self.url, self.device_uuid = url, uuid

    a, b, c = E("a", "GPU-1"), E("b", "GPU-0"), E("c", "GPU-9")
    per_rank, lost = assign([a, b, c], ["GPU-0", "GPU-1"])
    assert per_rank == [[b], [a]] and lost == [c]
    x, y, z = E("x", None), E("y", None), E("z", None)
    assert assign([x, y, z], [None, None]) == ([[x, z], [y]], [])
    assert ipc.device_uuid(torch.device("cpu")) is None


def test_each_engine_gets_its_own_ranks_weights(model_dir, tmp_path):
    engines = [IpcEngine(model_dir, tmp_path) for _ in range(2)]
    ctx = rank_context()
    out, go = ctx.Queue(), ctx.Event()
    port = free_port()
    urls = [e.url for e in engines]
    procs = [ctx.Process(target=rank_main, args=(r, port, urls, model_dir, out, go)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = {}
        for _ in range(2):
            kind, rank, what = out.get(timeout=300)
            assert kind == "published", what
        for r, e in enumerate(engines):
            want = rank_tensors(model_dir, r, 1)
            held = e.weights()
            assert set(want) <= set(held)
            for name, t in want.items():
                assert torch.equal(held[name], t), (r, name)
            assert version(e.url) == "1"
        go.set()
        for _ in range(2):
            kind, rank, what = out.get(timeout=300)
            assert kind == "done", what
            got[rank] = what
        ring, direct, kept = got[0]
        assert ring[0] == "ring" and ring[1] and ring[2] > 1 and ring[3] == sorted(urls) and ring[4] == 2
        assert direct[:3] == ("direct", False, 1) and kept[:3] == ("direct", False, 1)
        assert got[1] == [None, None, None]
        for r, e in enumerate(engines):
            want = rank_tensors(model_dir, r, 2)
            held = e.weights()
            for name, t in want.items():
                assert torch.equal(held[name], t), (r, name)
            assert version(e.url) == "3"
    finally:
        # By exit code, not join(): join() waited its whole timeout for ranks that had exited 0 (a process
        # a rank started outlives it and holds the rank's sentinel pipe open).
        deadline = time.monotonic() + 30
        for p in procs:
            while p.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if p.exitcode is None:
                p.kill()
        for e in engines:
            e.kill()
