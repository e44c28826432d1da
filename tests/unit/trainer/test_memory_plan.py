"""The trainer's memory plan (trainer/memory.py) on one CPU rank with a real model: the probe's saved
activations grow with the tokens and shrink under checkpointing; the plan keeps checkpointing off when the
longest sample fits, turns it on (on the model itself) when only that fits, lowers a micro-batch budget
that cannot fit, offloads the optimizer only past its threshold, and refuses, naming the settings, what
cannot fit at all; a planned learner's step trains as an unplanned one does and reports its peak memory."""

from __future__ import annotations

import pytest
import torch

import jobspec
from trainer import memory
from trainer.distributed import DistInfo, RankGroup
from trainer.learner import Learner
from trainer.logprobs import packed_logprobs
from trainer.packing import pack

MIB = 1 << 20


def _learner(model_dir, **trainer) -> Learner:
    spec = jobspec.from_dict(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"sampling": {"max_new_tokens": 16}},
            "trainer": {"fsdp": False, "logprob_chunk_tokens": 16} | trainer,
        }
    )
    pool = RankGroup(DistInfo(0, 1, "127.0.0.1", 0), torch.device("cpu"))
    ln = Learner(spec.model, spec.algorithm, spec.trainer, pool, response_budget=spec.response_budget)
    ln.setup()
    return ln


def _per_token(ln: Learner, tokens: int) -> int:
    mb = pack([memory.probe_sample(tokens, ln.config.vocab_size)])
    with memory.saved_bytes(ln.model) as saved:
        lp, _ = packed_logprobs(ln.model, mb, 1.0, "none", 16, False, False)
        loss = (lp * mb.token_weights).sum()
    loss.backward()
    ln.model.zero_grad(set_to_none=True)
    return saved[0]


def test_saved_activations_grow_with_the_tokens_and_shrink_when_checkpointed(tiny_model_dir):
    ln = _learner(tiny_model_dir)
    small, large = _per_token(ln, 128), _per_token(ln, 256)
    assert small > 0
    assert large / small == pytest.approx(2.0, rel=0.1)
    memory.set_checkpointing(ln.model, True)
    checkpointed = _per_token(ln, 256)
    memory.set_checkpointing(ln.model, False)
    assert checkpointed < 0.7 * large, (checkpointed, large)
    # the parameters are not activations: a model twice as wide saves about twice, not its weights
    assert large < memory.static_bytes(ln.model, 1), (large, memory.static_bytes(ln.model, 1))


def _plan(**kw):
    base = dict(
        capacity=64 * MIB,
        static=16 * MIB,
        per_token=4096,
        per_token_checkpointed=1024,
        transient=0,
        longest=2048,
        micro_batch_tokens=None,
        activation_checkpointing=None,
        offload_optimizer=False,
    )
    return memory.plan(**(base | kw))


def test_the_plan_checkpoints_only_when_the_longest_sample_needs_it():
    roomy = _plan()
    assert not roomy.activation_checkpointing
    assert roomy.micro_batch_tokens == 48 * MIB // 4096  # all that is left, below MAX_PLANNED_TOKENS
    tight = _plan(capacity=16 * MIB + 4 * MIB)  # 4 MiB left: 1024 plain tokens, 4096 checkpointed
    assert tight.activation_checkpointing and tight.micro_batch_tokens == 4096
    assert _plan(capacity=1 << 40).micro_batch_tokens == memory.MAX_PLANNED_TOKENS
    kept = _plan(activation_checkpointing=False, capacity=16 * MIB + 9 * MIB)
    assert not kept.activation_checkpointing and kept.micro_batch_tokens == 9 * MIB // 4096
    assert "activation checkpointing off" in roomy.describe()


def test_a_budget_that_cannot_fit_is_lowered_and_one_that_fits_is_kept(caplog):
    assert _plan(micro_batch_tokens=4096).micro_batch_tokens == 4096
    lowered = _plan(micro_batch_tokens=1 << 20)
    assert lowered.micro_batch_tokens == 48 * MIB // 4096
    assert "does not fit" in caplog.text


def test_what_cannot_fit_at_all_fails_at_start_naming_the_settings():
    with pytest.raises(memory.MemoryPlanError) as err:
        _plan(capacity=16 * MIB + MIB)  # 1 MiB left: 1024 checkpointed tokens < the longest sample's 2048
    msg = str(err.value)
    assert "longest sample (2048 tokens)" in msg
    assert "trainer.num_trainers" in msg and "trainer.offload_optimizer" in msg
    assert "activation_checkpointing" not in msg  # already on
    assert "max_new_tokens" in msg


def test_the_optimizer_is_offloaded_only_past_its_threshold():
    assert not memory.should_offload(70, 100)
    assert memory.should_offload(80, 100)
    assert not memory.should_offload(80, 0)  # CPU: nothing to plan against
    cpu = torch.device("cpu")
    assert memory.decide_offload(None, 1 << 40, cpu, fsdp=True) is False
    assert memory.decide_offload(True, 0, cpu, fsdp=True) is True


def test_a_tight_device_plans_checkpointing_onto_the_model_and_the_step_still_trains(tiny_model_dir):
    ln = _learner(tiny_model_dir)
    assert ln.memory_plan.capacity == 0 and ln.memory_plan.micro_batch_tokens == memory.CPU_MICRO_BATCH_TOKENS
    static = memory.static_bytes(ln.model, 1)
    transient = memory.transient_bytes(ln.config, 16, bf16=False)
    longest = ln.response_budget + memory.PROMPT_ALLOWANCE
    plain = memory.probe_per_token(
        ln.model, ln.device, ln.config.vocab_size, (16, False, False), ln._autocast
    )
    roomy = memory.plan_learner(ln, capacity=static + transient + 4 * longest * plain)
    assert not roomy.activation_checkpointing and roomy.micro_batch_tokens >= 4 * longest - 8
    assert not ln.model.model.gradient_checkpointing
    # room for the longest sample only when checkpointed
    tight = memory.plan_learner(ln, capacity=static + transient + longest * plain // 2)
    assert tight.activation_checkpointing and tight.micro_batch_tokens >= longest
    assert tight.micro_batch_tokens * tight.per_token <= tight.capacity - static - transient
    assert ln.model.model.gradient_checkpointing
    assert tight.static == static and 0 < tight.per_token < plain
    with pytest.raises(memory.MemoryPlanError):
        memory.plan_learner(ln, capacity=static)


def test_a_step_reports_its_peak_memory(tiny_model_dir):
    ln = _learner(tiny_model_dir)
    samples = [memory.probe_sample(24, ln.config.vocab_size, seed=s) for s in range(4)]
    stats = ln.train_step(ln.distribute(samples))
    assert stats["memory_peak_gib"] * memory.GIB > 10 * MIB  # the process's peak resident set on CPU


def test_saved_activations_are_counted_under_fsdp2_as_without_it():
    """FSDP2's parameters are DTensors, wrappers with no storage of their own: the probe reads their
    local shards (asking a DTensor for its storage raises, which failed every FSDP trainer on a GPU)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def saved(shard: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        if shard:
            fully_shard(model)
        with memory.saved_bytes(model) as out:
            model(torch.randn(5, 8)).sum().backward()
        return out[0]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = saved(True)
    finally:
        dist.destroy_process_group()
    assert sharded == saved(False) > 0
