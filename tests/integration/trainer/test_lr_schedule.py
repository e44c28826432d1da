"""The LR schedule (hand-computed factors), and the recipe options under FSDP2 on real gloo groups: with
GSPO, CISPO and decoupled PPO with sequence-level IS, masked IS, asymmetric clip, seq-mean-token-sum-norm
and an LR schedule, 2 ranks train like 1; a 1-rank checkpoint resumed on 2 ranks continues the schedule
(same lr per step, same losses, same weights) as the run that never stopped.

One spawned 1-rank run and one spawned 2-rank run; each trains every variant in turn (process start-up is
the slow part). Behaviour logprobs are the initial model's own plus noise, so ratios to them are near 1
and the clip, the masks and the truncation each catch some tokens, not all or none.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from oracles import lr_at
from rank_runs import one_then_two_ranks, read_record

import jobspec
from replay_buffer import Sample, make_group
from trainer.lr_schedule import lr_factor

STEPS = 4
TOTAL = 5  # algorithm.total_steps: the decay runs past the last step we take
CHECKPOINT_AFTER = 2
RESUMED = "decoupled"
VARIANTS = {
    "gspo": {
        "loss": "gspo",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "is_mask": "geometric",
        "is_mask_high": 1.3,
        "lr_schedule": "linear",
    },
    "cispo": {
        "loss": "cispo",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "loss_agg": "seq-mean-token-sum-norm",
        "loss_scale_factor": 16,
        "is_mask": "sequence",
        "is_mask_high": 3.0,
        "kl_coef": 0.05,
        "kl": "k3",
    },
    "decoupled": {
        "loss": "decoupled_ppo",
        "is_level": "sequence",
        "is_cap": 1.5,
        "is_mask": "token",
        "is_mask_low": 0.5,
        "is_mask_high": 1.6,
        "clip_eps_high": 0.28,
        "dual_clip_c": 3.0,
        "lr_schedule": "cosine",
        "lr_warmup_steps": 2,
        "min_lr_ratio": 0.1,
    },
}
KEYS = (
    "loss",
    "pg_loss",
    "grad_norm",
    "lr",
    "is_masked_fraction",
    "is_truncated_fraction",
    "clip_fraction",
    "behav_kl",
)


# --- the schedule itself ---------------------------------------------------------------------------
def test_cosine_with_warmup_and_floor_hand_computed():
    # warmup 2: (i + 1) / 2; then p = (i - 2) / (5 - 2); 0.1 + 0.9 * (1 + cos(pi p)) / 2
    got = [lr_factor(i, 5, "cosine", 2, 0.1) for i in range(6)]
    c = [0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2 for p in (1 / 3, 2 / 3)]
    assert got == pytest.approx([0.5, 1.0, 1.0, c[0], c[1], 0.1], rel=1e-12)
    assert c == pytest.approx([0.775, 0.325])


def test_linear_and_constant_hand_computed():
    assert [lr_factor(i, 4, "linear") for i in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert [lr_factor(i, 4, "linear", 0, 0.2) for i in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert [lr_factor(i, 10, "constant", 4) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    assert [lr_factor(i, 10, "constant") for i in range(3)] == [1.0, 1.0, 1.0]  # today's behaviour
    with pytest.raises(ValueError):
        lr_factor(0, 10, "step")


def test_spec_fields_and_checks():
    spec = jobspec.from_dict({"algorithm": {"lr": 2e-4, "lr_schedule": "cosine", "lr_warmup_steps": 3}})
    assert lr_at(0, spec.algorithm) == pytest.approx(2e-4 / 3)
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.algorithm\.min_lr_ratio"):
        jobspec.from_dict({"algorithm": {"min_lr_ratio": 1.5}})
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.algorithm\.is_level"):
        jobspec.from_dict({"algorithm": {"loss": "ppo", "is_level": "sequence"}})
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.algorithm\.is_mask_low"):
        jobspec.from_dict({"algorithm": {"is_mask_low": 0.5}})
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.algorithm\.clip_eps_low"):
        jobspec.from_dict({"algorithm": {"clip_eps_low": 1.0}})


# --- 2 ranks = 1 rank, and resume, with the recipe options on ----------------------------------------
def _spec(model_dir, world: int, variant: str):
    return jobspec.from_dict(
        {
            "model": {"path": str(model_dir)},
            "algorithm": {"lr": 1e-3, "total_steps": TOTAL, **VARIANTS[variant]},
            "trainer": {"num_trainers": world, "micro_batch_tokens": 40},
        }
    )


def _token_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float64 logprobs the model gives each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(response)[:, None])[
        :, 0
    ]


def _groups(step: int, model) -> list:
    """Deterministic groups of a step: varied lengths, tool tokens, and behaviour logprobs = the initial
    model's logprobs of the tokens plus N(0, 0.3) noise."""
    rng = np.random.default_rng(200 + step)
    vocab = model.config.vocab_size
    groups = []
    for g in range(4):
        samples = []
        for _ in range(3):
            n = int(rng.integers(2, 9))
            mask = (rng.random(n) > 0.2).astype(int)
            mask[0] = 1
            prompt = rng.integers(3, vocab, size=int(rng.integers(3, 7))).tolist()
            response = rng.integers(3, vocab, size=n).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
                -1, torch.tensor(response)[:, None]
            )
            behav = np.minimum(lp[:, 0].numpy() + rng.normal(0, 0.3, n), -1e-3) * mask
            samples.append(
                Sample.build(
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=mask.tolist(),
                    behavior_logprobs=behav.tolist(),
                    token_versions=[0] * n,
                    reward=float(rng.random() > 0.5),
                    finish_reason="stop",
                )
            )
        groups.append(make_group("t", f"p{step}-{g}", samples))
    return groups


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, resume: str | None) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from trainer import checkpoint
    from trainer.batch import build_samples, loss_aggregation
    from trainer.distributed import DistInfo, RankGroup
    from trainer.learner import Learner

    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), torch.device("cpu"))
    behaviour = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = [_groups(step, behaviour) for step in range(STEPS)] if pool.is_main else None
    if pool.is_main:  # behav_kl of step 0, where the trainer's policy is still the behaviour model
        log_r = []
        for s in (s for g in data[0] for s in g.samples):
            m = s.view("loss_mask") == 1
            lp = _token_logprobs(behaviour, s.view("prompt_ids").tolist(), s.view("response_ids").tolist())
            log_r.append(lp[torch.from_numpy(m)] - torch.from_numpy(s.view("behavior_logprobs")[m]).double())
        x = torch.cat(log_r)
        with open(os.path.join(out, f"behav-kl-{world}.json"), "w") as f:
            json.dump(
                {
                    "unbiased": float((x.exp() - 1 - x).mean()),  # r = pi_theta / pi_behav
                    "reverse": float(((-x).exp() - 1 + x).mean()),  # what behav_kl reported before
                },
                f,
            )

    def run(variant: str, first_step: int, resume_path: str | None, tag: str) -> None:
        spec = _spec(model_dir, world, variant)
        learner = Learner(spec.model, spec.algorithm, spec.trainer, pool)
        learner.setup()
        if resume_path:
            state = checkpoint.load(learner, resume_path)
            assert state["step"] == first_step
        record = {k: [] for k in KEYS}
        for step in range(first_step, STEPS):
            samples = None
            if pool.is_main:
                samples = build_samples(
                    data[step],
                    spec.algorithm.advantage,
                    *loss_aggregation(spec.algorithm, spec.trainer_config().response_budget),
                )
            stats = learner.train_step(learner.distribute(samples))
            for k in KEYS:
                record[k].append(stats[k])
            if tag == "fresh" and variant == RESUMED and step + 1 == CHECKPOINT_AFTER:
                checkpoint.save(
                    learner, os.path.join(out, f"ckpt-{world}"), {"step": step + 1, "version": step + 1}
                )
        params = {n: t.clone() for n, t in learner.full_parameters()}
        if pool.is_main:
            torch.save(params, os.path.join(out, f"params-{variant}-{tag}-{world}.pt"))
            with open(os.path.join(out, f"record-{variant}-{tag}-{world}.json"), "w") as f:
                json.dump(record, f)

    for variant in VARIANTS:
        run(variant, 0, None, "fresh")
    if resume:
        run(RESUMED, CHECKPOINT_AFTER, resume, "resumed")
    pool.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    return one_then_two_ranks(_worker, tiny_model_dir, tmp_path_factory.mktemp("recipe"))


def _assert_params_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_train_like_one_with_recipe_options(runs, variant):
    one, two = read_record(runs, variant, "fresh", 1), read_record(runs, variant, "fresh", 2)
    for key in KEYS:
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    alg = _spec("m", 1, variant).algorithm
    assert one["lr"] == pytest.approx([lr_at(i, alg) for i in range(STEPS)], rel=1e-12)
    # the options are exercised: masking drops some tokens but not all, the run learns
    assert 0 < max(one["is_masked_fraction"]) and min(one["is_masked_fraction"]) < 1
    assert all(v >= 0 for v in one["behav_kl"])
    assert one["loss"][0] != pytest.approx(one["loss"][-1])
    _assert_params_close(
        torch.load(runs / f"params-{variant}-fresh-1.pt"), torch.load(runs / f"params-{variant}-fresh-2.pt")
    )


def test_resumed_job_continues_the_lr_schedule(runs):
    one, resumed = read_record(runs, RESUMED, "fresh", 1), read_record(runs, RESUMED, "resumed", 2)
    alg = _spec("m", 1, RESUMED).algorithm
    assert resumed["lr"] == pytest.approx([lr_at(i, alg) for i in range(CHECKPOINT_AFTER, STEPS)], rel=1e-12)
    assert lr_at(0, alg) != pytest.approx(lr_at(CHECKPOINT_AFTER, alg))  # a restart from 0 would show
    for key in ("loss", "pg_loss", "grad_norm", "lr"):
        assert resumed[key] == pytest.approx(one[key][CHECKPOINT_AFTER:], rel=1e-4, abs=1e-6), key
    _assert_params_close(
        torch.load(runs / f"params-{RESUMED}-fresh-1.pt"), torch.load(runs / f"params-{RESUMED}-resumed-2.pt")
    )


def test_behav_kl_reports_kl_behav_to_trainer(runs):
    # step 0: the trainer's policy is the behaviour model itself, so the expected value is computable
    expected = json.loads((runs / "behav-kl-1.json").read_text())
    for variant in VARIANTS:
        got = read_record(runs, variant, "fresh", 1)["behav_kl"][0]
        assert got == pytest.approx(expected["unbiased"], rel=1e-4)
        assert got != pytest.approx(expected["reverse"], rel=1e-2)


def test_trainer_reports_lr_and_masked_fraction_in_progress_and_prometheus(
    redis_server, redis_client, job_id, tiny_model_dir, tmp_path
):
    """Trainer.run over groups put in a real Redis stream: each progress record carries lr,
    is_masked_fraction and behav_kl, and the Prometheus gauges show the last step's."""
    from prometheus_client import REGISTRY

    from trainer.trainer import Trainer

    spec = jobspec.from_dict(
        {
            "name": job_id,
            "output_dir": str(tmp_path / "out"),
            "model": {"path": str(tiny_model_dir)},
            "algorithm": {
                "groups_per_step": 2,
                "total_steps": 3,
                "lr_schedule": "linear",
                "lr_warmup_steps": 1,
                "min_lr_ratio": 0.5,
                "is_mask": "token",
                "is_mask_low": 0.5,
                "is_mask_high": 1.6,
            },
            "buffer": {"read_block_ms": 100, "max_staleness": 2},  # every group is made at version 0
            "trainer": {"export_hf": False},
        }
    )
    (tmp_path / "out").mkdir()
    trainer = Trainer(spec.trainer_config(), redis_server.url, [], None)
    try:
        trainer.setup()
        for step in range(2):
            for group in _groups(step, trainer.learner.model)[:3]:
                trainer.buffer.put(group)
        result = trainer.run()
        assert result.version == 3
        records = [json.loads(f[b"j"]) for _, f in redis_client.xrange(trainer.buffer.keys.progress)]
    finally:
        trainer.close()
    assert [r["lr"] for r in records] == pytest.approx([lr_at(i, spec.algorithm) for i in range(3)])
    # warmup 1 (step 0 at full lr), then linear over steps 1..3 to half: p = 0, 1/2
    assert [r["lr"] for r in records] == pytest.approx([1e-4, 1e-4, 0.75e-4])
    assert all(0 <= r["is_masked_fraction"] <= 1 and r["behav_kl"] >= 0 for r in records)
    assert 0 < max(r["is_masked_fraction"] for r in records)
    assert REGISTRY.get_sample_value("slipstream_trainer_lr") == pytest.approx(records[-1]["lr"])
    masked = REGISTRY.get_sample_value("slipstream_trainer_is_masked_fraction")
    assert masked == pytest.approx(records[-1]["is_masked_fraction"])
    assert REGISTRY.get_sample_value("slipstream_trainer_behav_kl") == pytest.approx(records[-1]["behav_kl"])
