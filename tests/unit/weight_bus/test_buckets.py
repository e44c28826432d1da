"""Bucketing and the flattened_bucket wire format, received over a real gloo group."""

import threading

import torch

from common.net import free_port
from weight_bus import WeightReceiver, buckets, flatten
from weight_bus.group import broadcast, dtype_name, new_group
from weight_bus.schema import InitWeightsUpdateGroup, UpdateWeightsFromDistributed


def test_buckets_respect_size_and_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])]
    plan = buckets(named, bucket_bytes=80)  # 80 B = 20 floats
    assert [[n for n, _ in b] for b in plan] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def _send_and_receive(named, load_format):
    port = free_port()
    recv = WeightReceiver()
    req = UpdateWeightsFromDistributed(
        names=[n for n, _ in named],
        dtypes=[dtype_name(t.dtype) for _, t in named],
        shapes=[list(t.shape) for _, t in named],
        load_format=load_format,
    )
    got = {}

    def engine():
        recv.init_group(
            InitWeightsUpdateGroup(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, backend="gloo"
            )
        )
        got["tensors"] = recv.receive(req)

    th = threading.Thread(target=engine)
    th.start()
    group = new_group("127.0.0.1", port, 0, 2, "gloo")
    if load_format == "flattened_bucket":
        broadcast(group, flatten(named))
    else:
        for _, t in named:
            broadcast(group, t)
    th.join(timeout=60)
    return got["tensors"]


def test_flattened_bucket_round_trip_mixed_dtypes():
    named = [
        ("w", torch.randn(3, 4)),
        ("b", torch.arange(5, dtype=torch.int64)),
        ("h", torch.randn(2, 2).to(torch.bfloat16)),
    ]
    got = _send_and_receive(named, "flattened_bucket")
    assert [n for n, _ in got] == ["w", "b", "h"]
    for (_, a), (_, b) in zip(named, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_per_tensor_round_trip():
    named = [("w", torch.randn(7)), ("v", torch.randn(2, 3))]
    got = _send_and_receive(named, None)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, got, strict=True))


def test_rank_offsets_give_every_tp_rank_its_own_rank():
    from weight_bus.packing import rank_offsets

    # trainer = rank 0; engines with TP 1, 2, 1 take ranks 1 | 2 3 | 4 (SGLang: rank_offset + tp_rank)
    assert rank_offsets([1, 2, 1]) == ([1, 2, 4], 5)
    assert rank_offsets([1, 1]) == ([1, 2], 3)


def test_master_address_is_loopback_only_while_every_engine_is_local():
    from weight_bus.group import master_address_for

    assert master_address_for(["http://127.0.0.1:3000", "http://localhost:3001"]) == "127.0.0.1"
    addr = master_address_for(["http://127.0.0.1:3000", "http://192.0.2.7:3000"])  # TEST-NET: no packet sent
    assert addr != "127.0.0.1" and addr.count(".") == 3
