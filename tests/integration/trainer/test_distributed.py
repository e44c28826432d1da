"""FSDP2 over real gloo process groups on CPU: 2 ranks train like 1, a 1-rank checkpoint resumes on 2 ranks
and continues identically, and the HF export loads with transformers and gives the same logits.

One spawned 1-rank run and one spawned 2-rank run (processes start slowly, so each does several checks).
The step's data, micro-batch budget and model are the same in both; only the split across ranks differs.
Every loss path is on at once: GAE with a critic, KL to a reference model, an entropy bonus, dual clip;
then again with mini-batch PPO (2 mini-batches x 2 epochs per step), where 2 ranks also take the same
optimizer steps as 1 and the clip acts.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from rank_runs import one_then_two_ranks, read_record

import jobspec
from replay_buffer import Sample, make_group

STEPS = 3
CHECKPOINT_AFTER = 1  # steps done when the checkpoint is written


def _groups(step: int, vocab: int):
    """Deterministic synthetic groups of a step: varied lengths, random behaviour logprobs, tool tokens."""
    rng = np.random.default_rng(100 + step)
    groups = []
    for g in range(4):
        samples = []
        for _ in range(3):
            n = int(rng.integers(2, 9))
            mask = (rng.random(n) > 0.2).astype(int)
            mask[0] = 1
            samples.append(
                Sample.build(
                    prompt_ids=rng.integers(3, vocab, size=int(rng.integers(3, 7))).tolist(),
                    response_ids=rng.integers(3, vocab, size=n).tolist(),
                    loss_mask=mask.tolist(),
                    behavior_logprobs=(-rng.random(n) * 4 * mask).tolist(),
                    token_versions=[0] * n,
                    reward=float(rng.random() > 0.5),
                    finish_reason="stop",
                )
            )
        groups.append(make_group("t", f"p{step}-{g}", samples))
    return groups


def _spec(model_dir, world: int, minibatches: bool = False):
    ppo = {"ppo_minibatches": 2, "ppo_epochs": 2, "clip_eps": 0.02} if minibatches else {}
    return jobspec.from_dict(
        {
            "model": {"path": str(model_dir)},
            "algorithm": ppo
            | {
                "advantage": "gae",
                "gamma": 0.95,
                "lam": 0.9,
                "kl_coef": 0.05,
                "kl": "k3",
                "entropy_coef": 0.01,
                "dual_clip_c": 3.0,
                "lr": 1e-3,
                "critic_lr": 1e-3,
            },
            "trainer": {"num_trainers": world, "micro_batch_tokens": 40},
        }
    )


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, resume: str | None) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from trainer import checkpoint
    from trainer.batch import build_samples
    from trainer.distributed import DistInfo, RankGroup, full_tensor
    from trainer.learner import Learner

    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), torch.device("cpu"))
    vocab = None

    def run(first_step: int, resume_path: str | None, tag: str) -> None:
        nonlocal vocab
        spec = _spec(model_dir, world, minibatches=tag == "minibatch")
        budget = spec.trainer_config().response_budget
        learner = Learner(spec.model, spec.algorithm, spec.trainer, pool, response_budget=budget)
        learner.setup()
        vocab = learner.config.vocab_size
        if resume_path:
            state = checkpoint.load(learner, resume_path)
            assert state["step"] == first_step
        keys = ("loss", "pg_loss", "value_loss", "kl_ref", "grad_norm", "clip_fraction", "optimizer_steps")
        record = {k: [] for k in keys} | {"mbs": [], "updates": []}
        for step in range(first_step, STEPS):
            samples = None
            if pool.is_main:
                alg = spec.algorithm
                samples = build_samples(_groups(step, vocab), alg.advantage, alg.loss_agg)
            mbs = learner.distribute(samples)
            stats = learner.train_step(mbs)
            for k in keys:
                record[k].append(stats[k])
            record["mbs"].append(len(mbs))
            record["updates"].append(learner.update_stats)
            if tag == "fresh" and step + 1 == CHECKPOINT_AFTER:
                checkpoint.save(
                    learner, os.path.join(out, f"ckpt-{world}"), {"step": step + 1, "version": step + 1}
                )
        params = {n: t.clone() for n, t in learner.full_parameters()}
        if world > 1 and pool.is_main:  # the publish's gather (one per FSDP unit) against one per parameter
            per_param = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters()}
            torch.save(per_param, os.path.join(out, f"params-per-param-{tag}-{world}.pt"))
        elif world > 1:
            for _, p in learner.model.named_parameters():
                full_tensor(p.detach())
        if tag == "fresh" and world == 1:
            checkpoint.export_hf(learner, os.path.join(out, "hf"))
            probe = torch.tensor([[2, 5, 7, 9, 4, 3, 8]])
            with torch.no_grad():
                logits = learner.model(input_ids=probe).logits
            torch.save({"probe": probe, "logits": logits}, os.path.join(out, "hf-probe.pt"))
        if pool.is_main:
            torch.save(params, os.path.join(out, f"params-{tag}-{world}.pt"))
            with open(os.path.join(out, f"record-{tag}-{world}.json"), "w") as f:
                json.dump(record, f)

    run(0, None, "fresh")
    run(0, None, "minibatch")
    if resume:
        run(CHECKPOINT_AFTER, resume, "resumed")
    pool.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    return one_then_two_ranks(_worker, tiny_model_dir, tmp_path_factory.mktemp("fsdp"))


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_two_ranks_train_like_one(runs):
    one, two = read_record(runs, "fresh", 1), read_record(runs, "fresh", 2)
    assert max(one["mbs"]) > 1  # the budget really splits the step into several micro-batches
    for key in ("loss", "pg_loss", "value_loss", "kl_ref", "grad_norm"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    # the runs learned something (losses move) and the weights after 3 steps agree
    assert one["loss"][0] != pytest.approx(one["loss"][-1])
    _assert_params_close(torch.load(runs / "params-fresh-1.pt"), torch.load(runs / "params-fresh-2.pt"))


def test_one_rank_checkpoint_resumes_on_two_ranks(runs):
    one, resumed = read_record(runs, "fresh", 1), read_record(runs, "resumed", 2)
    for key in ("loss", "pg_loss", "value_loss", "grad_norm"):
        assert resumed[key] == pytest.approx(one[key][CHECKPOINT_AFTER:], rel=1e-4, abs=1e-6), key
    _assert_params_close(torch.load(runs / "params-fresh-1.pt"), torch.load(runs / "params-resumed-2.pt"))


def test_hf_export_loads_with_transformers_and_gives_same_logits(runs):
    from transformers import AutoModelForCausalLM

    exported = runs / "hf"
    assert (exported / "model.safetensors").exists()
    config = json.loads((exported / "config.json").read_text())
    assert "slipstream" not in json.dumps(config)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    probe = torch.load(runs / "hf-probe.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["probe"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    trained = torch.load(runs / "params-fresh-1.pt")
    torch.testing.assert_close(model.model.embed_tokens.weight, trained["model.embed_tokens.weight"])


def test_two_ranks_take_the_same_minibatch_steps_as_one(runs):
    one, two = read_record(runs, "minibatch", 1), read_record(runs, "minibatch", 2)
    assert one["optimizer_steps"] == two["optimizer_steps"] == [4] * STEPS
    for key in ("loss", "pg_loss", "value_loss", "kl_ref", "grad_norm", "clip_fraction"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(one["updates"], two["updates"], strict=True):  # every optimizer step of every batch
        for key in ("loss", "clip_fraction", "grad_norm", "lr"):
            assert [u[key] for u in a] == pytest.approx([u[key] for u in b], rel=1e-4, abs=1e-6), key
    # the batch's first optimizer step is at pi_prox (no clip); later ones have moved, and the clip acts
    assert all(u[0]["clip_fraction"] == 0.0 for u in one["updates"])
    assert all(max(x["clip_fraction"] for x in u[1:]) > 0 for u in one["updates"])
    assert one["loss"] != pytest.approx(read_record(runs, "fresh", 1)["loss"])  # not the one-step path
    _assert_params_close(
        torch.load(runs / "params-minibatch-1.pt"), torch.load(runs / "params-minibatch-2.pt")
    )


def test_the_publish_gathers_each_fsdp_unit_once_and_gets_the_per_parameter_gather(runs):
    """On 2 ranks `full_parameters` gathers one FSDP unit at a time (one all-gather each): the same
    tensors, in the same order, bit for bit, as gathering every parameter alone (fp32 on CPU: no cast)."""
    for tag in ("fresh", "minibatch", "resumed"):
        by_unit = torch.load(runs / f"params-{tag}-2.pt")
        per_param = torch.load(runs / f"params-per-param-{tag}-2.pt")
        assert list(by_unit) == list(per_param)
        for name in by_unit:
            assert torch.equal(by_unit[name], per_param[name]), (tag, name)
