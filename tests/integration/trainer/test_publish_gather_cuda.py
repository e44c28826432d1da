"""The publish's gather on two CUDA ranks (NCCL, FSDP2 with bf16 mixed precision): `full_parameters`
gathers one FSDP unit at a time in the compute dtype, and gives, in the same order and bit for bit, what
gathering every parameter alone (fp32, through DTensor) and casting it to bf16 gives: the weights the
engines get are the ones the trainer's forward uses. Needs two CUDA devices (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch
from rank_runs import spawn_ranks

import jobspec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank each)"),
]


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, resume: str | None) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from trainer.distributed import DistInfo, RankGroup, full_tensor
    from trainer.learner import Learner

    torch.cuda.set_device(rank)
    spec = jobspec.from_dict(
        {"model": {"path": model_dir}, "trainer": {"device": "cuda", "num_trainers": world}}
    )
    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), torch.device("cuda", rank))
    learner = Learner(spec.model, spec.algorithm, spec.trainer, pool, response_budget=spec.response_budget)
    learner.setup()
    by_unit = {n: t.cpu() for n, t in learner.full_parameters()}
    per_param = {
        n: full_tensor(p.detach()).to(torch.bfloat16).cpu() for n, p in learner.model.named_parameters()
    }
    if rank == 0:
        torch.save({"by_unit": by_unit, "per_param": per_param}, os.path.join(out, "gathered.pt"))
    pool.close()


def test_two_cuda_ranks_gather_each_unit_in_bf16_as_the_per_parameter_gather_cast(tiny_model_dir, tmp_path):
    spawn_ranks(_worker, 2, tiny_model_dir, tmp_path)
    got = torch.load(tmp_path / "gathered.pt")
    by_unit, per_param = got["by_unit"], got["per_param"]
    assert list(by_unit) == list(per_param) and len(by_unit) > 3
    for name, t in by_unit.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, per_param[name]), name
