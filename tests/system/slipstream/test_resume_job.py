"""Checkpoint and resume through the whole system: a 1-rank job writes a checkpoint, a 2-rank job resumes
from it (resharded), republishes the restored weights to its engines and carries on from its version."""

import json

import pytest
import torch

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def _spec(tmp_path, model_dir, run: str, total_steps: int, **trainer) -> jobspec.JobSpec:
    return jobspec.from_dict(
        {
            "name": f"resume-{run}",
            "output_dir": str(tmp_path / run),
            "model": {"path": str(model_dir)},
            "rollout": {"group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 4}},
            "generators": {"num_engines": 1, "num_workers": 1},
            # The entropy bonus makes every step move the weights: with the untrained model's rewards often
            # all equal, GRPO advantages (and so the policy gradient) can be zero for a whole step.
            "algorithm": {"groups_per_step": 2, "total_steps": total_steps, "lr": 3e-3, "entropy_coef": 0.01},
            "buffer": {"max_staleness": 0},
            "trainer": trainer,
        }
    )


def test_one_rank_checkpoint_resumes_as_two_rank_job(tmp_path, tiny_model_dir):
    first = run_job(_spec(tmp_path, tiny_model_dir, "a", 2, checkpoint_every=2))
    assert first.version == 2
    ckpt_dir = tmp_path / "a" / "checkpoints"
    assert (ckpt_dir / "latest").read_text() == "step-00000002"
    state = json.loads((ckpt_dir / "step-00000002" / "trainer_state.json").read_text())
    assert state["version"] == 2 and state["world_size"] == 1 and state["buffer"]["consumed"] == 4

    seen = []
    second = run_job(
        _spec(
            tmp_path, tiny_model_dir, "b", 3, num_trainers=2, resume_from=str(ckpt_dir), checkpoint_every=1
        ),
        on_progress=seen.append,
    )
    assert second.version == 3
    assert [p["version"] for p in seen] == [3]  # one step: the job resumed at version 2, not 0
    assert second.buffer["steps"] == 1
    # On-policy (max_staleness 0): the engines sampled with the restored weights, so the trainer's
    # logprobs of the sampled tokens match the engine's. Engines left on the initial weights would not.
    assert seen[0]["logprob_diff_mean"] < 1e-4
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    # The exported final models differ by exactly the one step trained after the resume.
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(first.final_model).state_dict()
    b = AutoModelForCausalLM.from_pretrained(second.final_model).state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
