"""Async-vs-sync benchmark arithmetic and job building: rates and the learning summary on hand-made progress
records, merging learning files of like runs (and refusing unlike ones), the learning jobs on CPU and cuda,
length statistics of histograms, and the fp32-head jobs, ratios and side-by-side figures. No timing
thresholds: timings belong to the benchmark."""

import json

import pytest

from benchmarks.async_vs_sync import (
    base_spec,
    learning_job,
    learning_summary,
    main,
    make_spec,
    parse_args,
    rates,
)


def _rec(step, elapsed, step_s, wait_s, tokens, stale):
    return {
        "step": step,
        "elapsed_s": elapsed,
        "step_s": step_s,
        "wait_s": wait_s,
        "publish_s": 0.1,
        "publish_call_s": 0.3,
        "response_tokens": tokens,
        "staleness_mean": stale,
        "staleness_max": stale,
        "reward_mean": 0.5,
    }


def test_rates_exclude_warmup_steps():
    progress = [
        _rec(1, 10.0, 5.0, 5.0, 999, 0),
        _rec(2, 12.0, 1.0, 0.5, 40, 1),
        _rec(3, 14.0, 1.5, 0.2, 60, 2),
    ]
    m = rates(progress, [100.0, 102.0, 104.0], warmup=1, samples_per_step=8)
    # two timed steps of 8 samples over elapsed 14 - 10 = 4 s; the warm-up step's 999 tokens are not counted
    assert m["steps_timed"] == 2 and m["window_s"] == 4.0
    assert m["samples_per_s"] == 16 / 4 and m["tokens_per_s"] == 100 / 4
    assert m["trainer_busy_fraction"] == 2.5 / 4 and m["trainer_wait_fraction"] == 0.7 / 4
    assert m["trainer_publish_fraction"] == 0.2 / 4 and m["trainer_publish_call_fraction"] == 0.6 / 4
    assert m["trainer_other_fraction"] == pytest.approx(1 - (2.5 + 0.7 + 0.6) / 4)
    assert m["staleness_max"] == 2 and m["wall_window"] == [100.0, 104.0]


def test_learning_summary_spread_verdicts():
    curve = [{"reward_mean": 0.2}, {"reward_mean": 0.4}]
    curves = {k: {"0": curve, "1": curve} for k in ("sync", "async", "async_no_is")}
    finals = {
        "sync": {"0": 0.60, "1": 0.70},
        "async": {"0": 0.62, "1": 0.66},  # mean 0.64: inside sync's [0.60, 0.70]
        "async_no_is": {"0": 0.30, "1": 0.34},  # mean 0.32: 0.33 below sync's mean, spread 0.10
    }
    out = learning_summary(finals, curves, [0, 1], steps=2, window=1)
    assert out["sync_seed_range"] == [0.60, 0.70]
    assert out["async_within_sync_seed_range"] and out["async_within_seed_spread"]
    assert not out["async_no_is_within_sync_seed_range"] and not out["async_no_is_within_seed_spread"]
    assert out["async_no_is_minus_sync"] == pytest.approx(0.32 - 0.65)
    assert out["first_window_reward_mean"]["sync"] == 0.2
    assert out["async_not_worse_than_sync"] and not out["async_no_is_not_worse_than_sync"]
    # better than sync by more than the spread: not "within", but not worse either
    finals["async_no_is"] = {"0": 0.90, "1": 0.92}
    out = learning_summary(finals, curves, [0, 1], steps=2, window=1)
    assert not out["async_no_is_within_seed_spread"] and out["async_no_is_not_worse_than_sync"]


def _learning_file(path, seeds, *, device="nvidia-h100-x1", steps=3, job_seed=None, lr=5.0e-4):
    curve = [{"step": i + 1, "reward_mean": 0.1 * i, "elapsed_s": float(i)} for i in range(steps)]
    job = {
        "model": {"path": f"/m{seeds[0]}"},
        "dataset": {"name": "arith", "seed": seeds[0] if job_seed is None else job_seed},
        "algorithm": {"seed": seeds[0], "groups_per_step": 16, "lr": lr},
        "rollout": {"group_size": 8},
    }
    finals = {c: {str(s): 0.5 + 0.01 * s for s in seeds} for c in ("sync", "async", "async_no_is")}
    curves = {c: {str(s): curve for s in seeds} for c in finals}
    doc = {
        "benchmark": "async_vs_sync",
        "device": device,
        "command": f"python benchmarks/async_vs_sync.py --seed {seeds[0]}",
        "config": {"env": {"device_name": "x"}, "samples_per_step": 256, "learning_job": job},
        "learning": learning_summary(finals, curves, seeds, steps, 1),
    }
    path.write_text(json.dumps(doc))
    return path


def test_merge_learning_pools_whole_seeds_of_like_runs(tmp_path):
    a = _learning_file(tmp_path / "a.json", [0])
    b = _learning_file(tmp_path / "b.json", [1, 2])
    out = tmp_path / "out"
    result = main(["--merge-learning", str(a), str(b), "--out-dir", str(out)])
    [path] = out.glob("async_vs_sync-nvidia-h100-x1-learning-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    L = result["learning"]
    assert L["seeds"] == [0, 1, 2] and L["samples_per_step"] == 16 * 8  # the learning job's, not 256
    assert L["final_reward"]["sync"] == {"0": 0.5, "1": 0.51, "2": 0.52}
    assert [m["seeds"] for m in result["config"]["merged_from"]] == [[0], [1, 2]]
    assert sorted(p.name.rsplit("-", 1)[-1] for p in out.glob("*.png")) == [
        "reward_vs_samples.png",
        "reward_vs_time.png",
    ]


@pytest.mark.parametrize(
    "other, why",
    [
        ({"seeds": [0]}, "already in an earlier file"),
        ({"seeds": [1], "device": "cpu"}, "a different device or job"),
        ({"seeds": [1], "lr": 1e-3}, "a different device or job"),
        ({"seeds": [1], "steps": 4}, "different learning steps"),
    ],
)
def test_merge_learning_refuses_unlike_runs(tmp_path, other, why):
    a = _learning_file(tmp_path / "a.json", [0])
    b = _learning_file(tmp_path / "b.json", **other)
    with pytest.raises(SystemExit, match=why):
        main(["--merge-learning", str(a), str(b), "--out-dir", str(tmp_path / "out")])


def _valid(raw, tmp_path):
    return make_spec(raw, name="x", out=tmp_path / "x", max_staleness=2, total_steps=3)


def test_cuda_learning_jobs_use_the_tiny_arith_job_on_the_gpu_stack(tmp_path):
    """On cuda the throughput job (random-weight shape model, tool task) has nothing to learn, so the
    learning jobs run the demo's a+b job on the tiny-arith model through the same GPU stack."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text("{}")  # an already-built model directory is reused as is
    args = parse_args(["--device", "cuda", "--tiny-model-dir", str(tiny), "--bus-backend", "gloo"])
    raw = base_spec(args, tmp_path / "shape-model")
    assert raw["dataset"]["name"] == "word_problems" and raw["algorithm"]["groups_per_step"] == 32

    lraw, lmodel = learning_job(args, raw, tmp_path / "shape-model", tmp_path)
    assert lmodel == tiny.resolve()
    assert lraw["model"]["path"] == str(tiny.resolve())
    assert lraw["dataset"]["name"] == "arith" and lraw["reward"]["name"] == "arith"
    assert lraw["generators"]["engine"] == "external" and lraw["trainer"]["device"] == "cuda"
    assert lraw["bus"]["backend"] == "gloo" and lraw["algorithm"]["groups_per_step"] == 16
    spec = _valid(lraw, tmp_path)
    assert spec.trainer.device == "cuda" and spec.algorithm.lr == 5.0e-4

    job_args = parse_args(["--device", "cuda", "--learning-model", "job"])
    assert learning_job(job_args, raw, tmp_path / "m", tmp_path) == (raw, tmp_path / "m")


def test_cpu_learning_jobs_are_the_throughput_job(tmp_path):
    args = parse_args(["--groups-per-step", "8"])
    raw = base_spec(args, tmp_path / "tiny")
    assert raw["generators"]["engine"] == "builtin" and raw["bus"]["backend"] == "gloo"
    lraw, lmodel = learning_job(args, raw, tmp_path / "tiny", tmp_path)
    assert lraw == raw and lmodel == tmp_path / "tiny"
    _valid(lraw, tmp_path)
    lraw, _ = learning_job(parse_args(["--learning-groups-per-step", "4"]), raw, tmp_path / "tiny", tmp_path)
    assert lraw["algorithm"]["groups_per_step"] == 4 and raw["algorithm"]["groups_per_step"] == 8


def test_length_statistics_of_histograms():
    from benchmarks.async_vs_sync.lengths import ks_2samp, summary

    assert summary({}) == {"n": 0, "mean": None, "p50": None, "p90": None}
    assert summary({1: 5, 10: 4, 100: 1}) == {"n": 10, "mean": 14.5, "p50": 1, "p90": 10}
    same = ks_2samp({3: 10, 7: 10}, {3: 10, 7: 10})
    assert same["d"] == 0 and same["p"] == 1.0
    # every sample of one above every sample of the other: D = 1, and with 50 each p is tiny
    apart = ks_2samp({1: 50}, {9: 50})
    assert apart["d"] == 1 and apart["p"] < 1e-10
    # half the mass moved: D = 0.5; the asymptotic p at n = 20 per side is about 0.01
    half = ks_2samp({1: 20}, {1: 10, 9: 10})
    assert half["d"] == 0.5 and 0.001 < half["p"] < 0.05
    assert ks_2samp({1: 3}, {})["d"] is None


def test_fp32_heads_job_sets_both_sides(tmp_path):
    """--fp32-lm-head: built-in engines take generators.fp32_lm_head (the trainer's follows); with the cuda
    path's external engine the job sets trainer.fp32_lm_head (and the engine is started with the flag)."""
    from benchmarks.async_vs_sync.fp32_head import with_fp32_heads

    cpu = base_spec(parse_args([]), tmp_path / "m")
    spec = _valid(with_fp32_heads(cpu), tmp_path)
    assert spec.generators.fp32_lm_head and spec.trainer_fp32_lm_head
    assert not _valid(cpu, tmp_path).trainer_fp32_lm_head and "fp32_lm_head" not in cpu["generators"]
    cuda = base_spec(parse_args(["--device", "cuda"]), tmp_path / "m")
    spec = _valid(with_fp32_heads(cuda), tmp_path)
    assert spec.generators.engine == "external" and spec.trainer.fp32_lm_head and spec.trainer_fp32_lm_head
    # the GPU command's job: the a+b task colocated on one GPU (--fp32-head-model tiny-arith, the default)
    args = parse_args(["--device", "cuda", "--placement", "colocated", "--fp32-lm-head", "both"])
    assert args.fp32_head_model == "tiny-arith" and args.staleness == "0"
    colocated = base_spec(args, tmp_path / "m", task="arith")
    spec = _valid(with_fp32_heads(colocated), tmp_path)
    assert spec.generators.fp32_lm_head and spec.trainer_fp32_lm_head and spec.trainer.fp32_lm_head is None
    assert spec.placement == "colocated" and spec.trainer.device == "cuda" and spec.dataset.name == "arith"


def test_fp32_head_ratios_and_side_by_side_figures():
    from benchmarks.async_vs_sync.fp32_head import fp32_head_ratios, mismatch, side_by_side

    recs = [{"logprob_diff_mean": 0.03, "behav_kl": 0.002}, {"logprob_diff_mean": 0.01, "behav_kl": None}]
    m = mismatch(recs)
    assert m["logprob_abs_diff_mean"] == pytest.approx(0.02) and m["kl_k3_mean"] == 0.002
    assert m["trainer_fp32_lm_head"] == [False]

    def run(lp, kl, sps):
        return {"logprob_abs_diff_mean": lp, "kl_k3_mean": kl, "samples_per_s": sps, "tokens_per_s": 10 * sps}

    runs = {
        "0": {"bf16_head": run(0.04, 0.002, 100.0), "fp32_head": run(0.03, 0.001, 80.0)},
        "2": {"bf16_head": run(0.02, 0.004, 200.0), "fp32_head": run(0.01, 0.001, 150.0)},
        "4": {"bf16_head": run(0.02, 0.004, 200.0)},  # the fp32 job did not finish: no ratio
    }
    r = fp32_head_ratios(runs)
    assert (
        r["fp32_vs_bf16_head_logprob_abs_diff"] == r["fp32_vs_bf16_head_logprob_abs_diff_staleness_2"] == 0.5
    )
    assert r["fp32_vs_bf16_head_kl_k3"] == 0.25 and r["fp32_vs_bf16_head_samples_per_s"] == 0.75
    assert r["fp32_vs_bf16_head_kl_k3_staleness_0"] == 0.5
    assert not any(k.endswith("_staleness_4") for k in r)
    flat = side_by_side(runs)
    assert (
        flat["logprob_abs_diff_fp32_head_staleness_0"] == 0.03
        and flat["kl_k3_bf16_head_staleness_2"] == 0.004
    )
    assert flat["samples_per_s_bf16_head_staleness_4"] == 200.0


def test_the_model_cache_builds_a_shape_once_and_hands_it_back(tmp_path, monkeypatch):
    """$SLIPSTREAM_BENCH_MODEL_CACHE: the first phase builds the model there (no half-written directory
    left), the next takes it without building; unset, each call builds into its own work directory."""
    import argparse

    import transformers

    from benchmarks import shapes
    from benchmarks.async_vs_sync import job

    monkeypatch.setitem(
        shapes.SHAPES,
        "test-shape",
        dict(
            hidden_size=32,
            num_hidden_layers=1,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=256,
            tie_word_embeddings=True,
        ),  # fmt: skip
    )
    args = argparse.Namespace(model_shape="test-shape", full_vocab=False, seed=0)
    monkeypatch.setenv(job.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    first = job.build_cuda_model(args, tmp_path / "work1")
    assert first.parent == tmp_path / "cache" and (first / "config.json").exists()
    assert [p.name for p in first.parent.iterdir()] == [first.name]

    def no_build(*a, **k):
        raise AssertionError("built again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_build)
    assert job.build_cuda_model(args, tmp_path / "work2") == first
    monkeypatch.delenv(job.MODEL_CACHE_ENV)
    with pytest.raises(AssertionError, match="built again"):
        job.build_cuda_model(args, tmp_path / "work3")
