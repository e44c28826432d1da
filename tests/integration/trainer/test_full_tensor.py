"""`trainer.distributed.full_tensor` on a mesh of one rank (a one-GPU trainer, colocated): every FSDP2
parameter comes back whole, as the rank's own storage, without DTensor's gather (which the test makes
fail), in a spawned 1-rank gloo group."""

from __future__ import annotations

import os

import torch
from rank_runs import start_ranks

from common.net import free_port


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainer.distributed import DistInfo, RankGroup, full_tensor

    pool = RankGroup(DistInfo(rank, 1, "127.0.0.1", port), torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3, bias=False))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model:
        fully_shard(layer)
    fully_shard(model)

    def gather_called(self, *a, **k):
        raise AssertionError("full_tensor gathered on a mesh of one rank")

    DTensor.full_tensor = gather_called
    got = {}
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor)
        t = full_tensor(p.detach())
        assert not isinstance(t, DTensor) and t.data_ptr() == p.to_local().data_ptr()
        got[n] = t.clone()
    torch.save({"before": before, "got": got}, out)
    pool.close()


def test_one_rank_returns_its_own_tensors_without_a_gather(tmp_path):
    out = str(tmp_path / "out.pt")
    start_ranks(_worker, (free_port(), out), 1)
    res = torch.load(out)
    assert res["got"].keys() == res["before"].keys()
    for n, t in res["before"].items():
        assert torch.equal(res["got"][n], t), n
