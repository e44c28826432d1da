"""The trainer's memory plan on a GPU held to an 80 GB H100's memory (`set_per_process_memory_fraction`):
a Qwen2.5-1.5B-shaped model (random weights, the real vocabulary) at the default settings plans its
micro-batches and trains steps of samples as long as the plan's longest without running out of memory,
its peak within the plan's capacity. The learner runs as a job's trainer rank does: FSDP2 over a process
group (of one rank here). Needs CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

import jobspec
from common.net import free_port
from trainer import memory
from trainer.distributed import DistInfo, RankGroup
from trainer.learner import Learner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
H100_BYTES = 80 * 10**9
"""An 80 GB H100's memory (the card the defaults must fit)."""


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.shapes import config_kwargs

    path = tmp_path_factory.mktemp("qwen-1.5b-shape")
    config = Qwen2Config(**config_kwargs("qwen2.5-1.5b-shape"))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def test_a_1_5b_model_plans_and_trains_within_an_h100(shape_dir):
    _, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(min(1.0, H100_BYTES / total))
    spec = jobspec.from_dict(
        {
            "model": {"path": str(shape_dir)},
            "rollout": {"sampling": {"max_new_tokens": 4096}},
            "trainer": {"device": "cuda"},
        }
    )
    # what earlier tests of this process still hold (module fixtures' engines, cached models) is not the
    # learner's: its peak is counted above this
    baseline = torch.cuda.memory_allocated()
    pool = RankGroup(DistInfo(0, 1, "127.0.0.1", free_port()), torch.device("cuda", 0))
    ln = Learner(spec.model, spec.algorithm, spec.trainer, pool, response_budget=spec.response_budget)
    ln.setup()
    assert ln.fsdp
    plan = ln.memory_plan
    print(plan.describe())
    assert plan.capacity > 0 and plan.micro_batch_tokens >= plan.longest
    assert not plan.offload_optimizer  # 1.5B's static state (~25 GB) is well under 3/4 of 80 GB
    # a step of samples as long as the longest the plan allows, filling several micro-batches
    vocab = ln.config.vocab_size
    n = 3 * plan.micro_batch_tokens // plan.longest + 1
    samples = [memory.probe_sample(plan.longest, vocab, seed=s) for s in range(n)]
    for _ in range(2):
        stats = ln.train_step(ln.distribute(samples))
    peak = stats["memory_peak_gib"] * memory.GIB - baseline
    print(
        f"peak {peak / memory.GIB:.1f} GiB of {plan.capacity / memory.GIB:.1f} GiB planned "
        f"(above {baseline / memory.GIB:.1f} GiB held before the learner)"
    )
    assert peak <= plan.capacity
