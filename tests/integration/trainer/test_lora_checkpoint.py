"""LoRA checkpoints and exports over real gloo process groups on CPU.

A 1-rank FSDP2 LoRA run trains STEPS batches (2 mini-batches each, so AdamW state matters) and checkpoints
after CHECKPOINT_AFTER; a 2-rank pool resumes from that checkpoint and its next steps' losses, gradient norms
and final adapter tensors equal the uninterrupted 1-rank run's (the tolerance of the full-weight resume test,
tests/integration/trainer/test_distributed.py: rel 1e-4 / abs 1e-6 on stats, rtol 1e-4 / atol 1e-5 on tensors). The
checkpoint holds the adapter and its optimizer state only, and records the base's fingerprint; a resume on
another base, another adapter shape, or across LoRA / full fine-tuning is refused with the spec key. The
export's adapter directory loads with `peft.PeftModel.from_pretrained`, its merged directory with
`AutoModelForCausalLM.from_pretrained`, and both give the trainer's fp32 logits.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from rank_runs import one_then_two_ranks, read_record
from test_distributed import _groups

import jobspec
from models.config import LoraSpec

STEPS = 3
CHECKPOINT_AFTER = 1
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
PROBE = [[2, 5, 7, 9, 4, 3, 8, 6]]


def _spec(model_dir, world: int, lora: dict | None = LORA, fsdp: bool = True):
    spec = jobspec.from_dict(
        {
            "model": {"path": str(model_dir)},
            "algorithm": {"lr": 2e-2, "ppo_minibatches": 2, "clip_eps": 0.1, "groups_per_step": 4},
            "rollout": {"group_size": 3},
            "trainer": {"num_trainers": world, "micro_batch_tokens": 40, "fsdp": fsdp},
        }
    )
    # set on the section: a whole job with model.lora is refused at submit until the bus sends adapters
    spec.model.lora = None if lora is None else LoraSpec(**lora)
    return spec


def _learner(spec, pool):
    from trainer.learner import Learner

    learner = Learner(
        spec.model, spec.algorithm, spec.trainer, pool, response_budget=spec.trainer_config().response_budget
    )
    learner.setup()
    return learner


def _step(learner, spec, step: int, vocab: int) -> dict:
    from trainer.batch import build_samples, loss_aggregation

    samples = None
    if learner.ranks.is_main:
        alg = spec.algorithm
        agg = loss_aggregation(alg, spec.trainer_config().response_budget)
        samples = build_samples(_groups(step, vocab), alg.advantage, *agg)
    return learner.train_step(learner.distribute(samples))


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, resume: str | None) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from trainer import checkpoint
    from trainer.distributed import DistInfo, RankGroup

    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), torch.device("cpu"))
    spec = _spec(model_dir, world)
    learner = _learner(spec, pool)
    vocab = learner.config.vocab_size
    first = 0
    if resume:
        first = checkpoint.load(learner, resume)["step"]
    record = {"loss": [], "grad_norm": [], "updates": []}
    for step in range(first, STEPS):
        stats = _step(learner, spec, step, vocab)
        record["loss"].append(stats["loss"])
        record["grad_norm"].append(stats["grad_norm"])
        record["updates"].append([u["loss"] for u in learner.update_stats])
        if not resume and step + 1 == CHECKPOINT_AFTER:
            checkpoint.save(
                learner, os.path.join(out, f"ckpt-{world}"), {"step": step + 1, "version": step + 1}
            )
    adapter = {n: t.clone() for n, t in learner.adapter_tensors()}
    tag = "resumed" if resume else "fresh"
    if not resume:
        with torch.no_grad():
            logits = learner.model(input_ids=torch.tensor(PROBE)).logits
        checkpoint.export_hf(learner, os.path.join(out, "hf"), merged=True)
    if pool.is_main:
        torch.save(adapter, os.path.join(out, f"adapter-{tag}-{world}.pt"))
        if not resume:
            torch.save(logits, os.path.join(out, "probe-logits.pt"))
        with open(os.path.join(out, f"record-{tag}-{world}.json"), "w") as f:
            json.dump(record, f)
    pool.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    return one_then_two_ranks(_worker, tiny_model_dir, tmp_path_factory.mktemp("lora-fsdp"))


def test_one_rank_lora_checkpoint_resumes_on_two_ranks(runs):
    one, resumed = read_record(runs, "fresh", 1), read_record(runs, "resumed", 2)
    assert len(one["loss"]) == STEPS and len(resumed["loss"]) == STEPS - CHECKPOINT_AFTER
    for key in ("loss", "grad_norm"):
        assert resumed[key] == pytest.approx(one[key][CHECKPOINT_AFTER:], rel=1e-4, abs=1e-6), key
    for a, b in zip(resumed["updates"], one["updates"][CHECKPOINT_AFTER:], strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)  # each mini-batch's optimizer step
    assert one["loss"][0] != pytest.approx(one["loss"][-1])  # the adapter learned: the losses move
    fresh, again = torch.load(runs / "adapter-fresh-1.pt"), torch.load(runs / "adapter-resumed-2.pt")
    assert fresh.keys() == again.keys() and len(fresh) == 2 * 4 * 2  # 2 layers x 4 targets x (A, B)
    for name in fresh:
        torch.testing.assert_close(again[name], fresh[name], rtol=1e-4, atol=1e-5, msg=name)
    assert any(t.abs().max() > 0 for n, t in fresh.items() if ".lora_B." in n)


def test_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(runs, tiny_model_dir):
    import torch.distributed.checkpoint as dcp

    path = runs / "ckpt-1"
    keys = list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("policy.model.")]
    optim_keys = [k for k in keys if k.startswith("policy.optim.state.")]
    assert model_keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in model_keys), (
        model_keys[:3]
    )
    assert len(model_keys) == 2 * 4 * 2
    # AdamW's moments of every adapter tensor (its step count too)
    for moment in ("exp_avg", "exp_avg_sq"):
        assert sum(k.endswith(moment) for k in optim_keys) == len(model_keys)
    assert not [k for k in keys if "base_layer" in k or "embed_tokens" in k or "lm_head" in k]
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["lora"] == {
        "name": "policy",
        "rank": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": sorted(LORA["target_modules"]),
    }
    assert state["base"]["path"] == str(tiny_model_dir)
    assert len(state["base"]["weights"]) == 16
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert state["base"]["config"]["hidden_size"] == config["hidden_size"]
    assert not [k for k in state["base"]["config"] if k.startswith("_") or k == "transformers_version"]
    base_bytes = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    ckpt_bytes = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert ckpt_bytes < base_bytes / 2  # the frozen base is not in it


def test_adapter_and_merged_exports_give_the_trainers_logits(runs, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = runs / "hf"
    want = torch.load(runs / "probe-logits.pt")
    ids = torch.tensor(PROBE)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, hf / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(hf / "merged", dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        via_peft = peft_model(input_ids=ids).logits
        via_merged = merged(input_ids=ids).logits
        via_base = plain(input_ids=ids).logits
    torch.testing.assert_close(via_peft, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(via_merged, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(via_base, want, atol=1e-3)  # the adapter is in the comparison
    # the merged weights are PEFT's own merge_and_unload of the exported adapter
    peft_merged = dict(peft_model.merge_and_unload().named_parameters())
    mine = dict(merged.named_parameters())
    assert mine.keys() == peft_merged.keys()
    for name, p in mine.items():
        torch.testing.assert_close(p, peft_merged[name], rtol=1e-6, atol=1e-6, msg=name)
    changed = [n for n, p in mine.items() if not torch.equal(p, dict(plain.named_parameters())[n])]
    assert changed and all(n.split(".")[-2] in LORA["target_modules"] for n in changed)


# --- refusals (one process, no FSDP: resharding is not what they check) ---------------------------------


def _local(spec):
    from trainer.distributed import DistInfo, RankGroup

    return _learner(spec, RankGroup(DistInfo(0, 1, "127.0.0.1", 0), torch.device("cpu")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model_dir):
    """A LoRA checkpoint after one step (the adapter's B no longer zero), and the adapter it holds."""
    from trainer import checkpoint

    out = tmp_path_factory.mktemp("lora-ckpt")
    spec = _spec(tiny_model_dir, 1, fsdp=False)
    learner = _local(spec)
    _step(learner, spec, 0, learner.config.vocab_size)
    path = checkpoint.save(learner, out / "ckpt", {"step": 1, "version": 1})
    assert _checkpoint_bytes() == sum(f.stat().st_size for f in path.iterdir())
    return path, dict(learner.adapter_tensors()), learner.opt.state_dict()


def _checkpoint_bytes() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("slipstream_trainer_checkpoint_bytes")


def test_same_base_at_another_path_resumes_the_adapter_and_optimizer(saved, tiny_model_dir, tmp_path, caplog):
    from trainer import checkpoint

    path, adapter, opt_state = saved
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model_dir, moved)
    learner = _local(_spec(moved, 1, fsdp=False))
    with caplog.at_level("INFO", logger="trainer.checkpoint"):
        state = checkpoint.load(learner, path)
    assert state["step"] == 1 and learner.lr_step == 2
    assert "resumed LoRA adapter 'policy'" in caplog.text
    for name, t in learner.adapter_tensors():
        assert torch.equal(t, adapter[name]), name
    got = learner.opt.state_dict()["state"]
    assert got.keys() == opt_state["state"].keys()
    for i, s in got.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[k], opt_state["state"][i][k]), (i, k)


def test_another_base_is_refused_at_model_path(saved, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer import checkpoint

    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1.01)  # same architecture, other weights
    model.save_pretrained(other)
    learner = _local(_spec(other, 1, fsdp=False))
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"^model\.path: .*another model \(weights: "):
        checkpoint.load(learner, saved[0])
    config = json.loads((tiny_model_dir / "config.json").read_text())
    shutil.copytree(tiny_model_dir, tmp_path / "eps")  # same weights, another norm epsilon
    (tmp_path / "eps" / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.125}))
    learner = _local(_spec(tmp_path / "eps", 1, fsdp=False))
    with pytest.raises(
        checkpoint.CheckpointMismatch, match=r"^model\.path: .*\(config: rms_norm_eps .* 0\.125 now"
    ):
        checkpoint.load(learner, saved[0])


def test_another_adapter_or_full_weights_are_refused_at_model_lora(saved, tiny_model_dir, tmp_path):
    from trainer import checkpoint

    path = saved[0]
    learner = _local(_spec(tiny_model_dir, 1, lora=LORA | {"rank": 8}, fsdp=False))
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"^model\.lora: .*rank 4 in the checkpoint, 8"):
        checkpoint.load(learner, path)
    full = _local(_spec(tiny_model_dir, 1, lora=None, fsdp=False))
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"^model\.lora: .*holds a LoRA adapter"):
        checkpoint.load(full, path)
    full_ckpt = checkpoint.save(full, tmp_path / "full", {"step": 0, "version": 0})
    # the full checkpoint's weights and AdamW moments are 3x the base; the adapter's are a sliver of it
    lora_bytes = sum(f.stat().st_size for f in path.iterdir())
    assert lora_bytes * 10 < _checkpoint_bytes()
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"^model\.lora: .*holds full weights"):
        checkpoint.load(_local(_spec(tiny_model_dir, 1, fsdp=False)), full_ckpt)


def test_export_merged_spec_checks():
    with pytest.raises(jobspec.JobSpecError, match=r"only with model\.lora.*\$\.trainer\.export_merged`"):
        jobspec.from_dict({"trainer": {"export_merged": True}})
    with pytest.raises(jobspec.JobSpecError, match=r"needs export_hf.*\$\.trainer\.export_merged`"):
        jobspec.from_dict({"trainer": {"export_merged": True, "export_hf": False}})


# --- the trainer's own checkpoint, resume and final export (real redis-server, no engines) ------------------


def _trainer(job_id, model_dir, out, redis_url, **trainer):
    from trainer.trainer import Trainer

    spec = jobspec.from_dict(
        {
            "name": job_id,
            "output_dir": str(out),
            "model": {"path": str(model_dir)},
            "algorithm": {"groups_per_step": 2},
            "bus": {"backend": "gloo", "timeout_s": 10.0},
        }
    )
    spec.model.lora = LoraSpec(**LORA)  # on the section: a whole job with model.lora is refused at submit
    for key, value in trainer.items():
        setattr(spec.trainer, key, value)
    t = Trainer(spec.trainer_config(), redis_url, [], None)
    t.setup()
    return t


def test_trainer_checkpoints_resumes_and_exports_merged(redis_server, job_id, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    first = _trainer(job_id, tiny_model_dir, tmp_path / "out", redis_server.url, export_merged=True)
    try:
        with torch.no_grad():  # an adapter that changes the outputs (B = 0 at the start)
            for name, p in first.learner.model.named_parameters():
                if ".lora_B." in name:
                    p.add_(0.05)
        path = first.checkpoint(0)
        adapter = dict(first.learner.adapter_tensors())
        first.learner.model.eval()
        with torch.no_grad():
            want = first.learner.model(input_ids=torch.tensor(PROBE)).logits
        final = first.save(tmp_path / "out" / "final_model")
    finally:
        first.close()
    merged = AutoModelForCausalLM.from_pretrained(f"{final}/merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=torch.tensor(PROBE)).logits, want, rtol=1e-5, atol=1e-5)

    second = _trainer(job_id, tiny_model_dir, tmp_path / "out", redis_server.url, resume_from=str(path))
    try:
        assert second._resumed == (0, path)
        for name, t in second.learner.adapter_tensors():
            assert torch.equal(t, adapter[name]), name
    finally:
        second.close()
