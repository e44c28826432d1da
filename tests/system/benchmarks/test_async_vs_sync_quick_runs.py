"""Async-vs-sync benchmark, quick CPU runs of real jobs on local Ray: the run as three phase commands
(max_staleness 0 and 2, then the generator-only / trainer-only session) writes one result file in the
result-file format (benchmarks/README.md) with the headline names, and --fp32-lm-head both runs each job
with and without the fp32 head. No timing thresholds: timings belong to the benchmark."""

import json

import pytest

from benchmarks.async_vs_sync import main

# run_job and the bounds phase on the session's Ray
pytestmark = pytest.mark.usefixtures("shared_ray")


def test_quick_run_in_phase_commands_writes_one_result_file_with_headline_names(tmp_path, capsys):
    """The run as three phase commands appending to one file (each short enough for one device call): the
    sync job, the async job, then the bounds; the ratios are those of the whole."""
    base = ["--quick", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path)]
    phases = [["--phase", "staleness", "--staleness", "0"], ["--phase", "staleness", "--staleness", "2"]]
    phases.append(["--phase", "bounds"])
    for i, phase in enumerate(phases):
        result = main([*base, *phase, *(["--append"] if i else [])])
        if i == 0:  # the sync job alone: no ratio yet, nothing claimed
            assert (
                result["ratios"].get("async_vs_sync") is None
                and "pipeline_bound_samples_per_s" not in result["metrics"]
            )

    [path] = tmp_path.glob("async_vs_sync-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["errors"] == []
    assert len(on_disk["commands"]) == 3 and on_disk["commands"][-1].endswith("--phase bounds --append")
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "async_vs_sync" and on_disk["device"] == "cpu"
    assert path.name == f"async_vs_sync-cpu-{on_disk['date'].replace('-', '')}.json"
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["async_vs_sync_uses"] == "max_staleness=2" and m["headline_staleness"] == 2
    sync, async_ = m["runs"]["0"], m["runs"]["2"]
    # the same job: same number of trained samples; sync is strictly on-policy, async stays within its bound
    steps = cfg["steps_timed"] + cfg["warmup_steps"]
    for run in (sync, async_):
        assert len(run["progress"]) == steps and run["buffer"]["consumed"] == steps * 4
    assert sync["staleness_histogram"] == {"0": steps * 4}
    assert all(p["staleness_max"] <= 2 for p in async_["progress"])
    assert m["generator_only"]["samples_per_s"] > 0 and m["trainer_only"]["samples_per_s"] > 0
    assert m["trainer_only"]["steps_timed"] == cfg["steps_timed"]
    bound = min(m["generator_only"]["samples_per_s"], m["trainer_only"]["samples_per_s"])
    assert r["async_vs_sync"] == async_["samples_per_s"] / sync["samples_per_s"]
    assert r["async_vs_pipeline_bound"] == async_["samples_per_s"] / bound
    assert 0 < sync["trainer_busy_fraction"] <= 1
    assert [p.rsplit("-", 1)[-1] for p in on_disk["plots"]] == [
        "throughput.png",
        "reward_vs_samples.png",
        "reward_vs_time.png",
    ]
    assert all((tmp_path / p.rsplit("/", 1)[-1]).stat().st_size > 0 for p in on_disk["plots"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("async_vs_sync async_vs_sync=")


def test_fp32_head_both_runs_each_job_with_and_without(tmp_path, capsys):
    argv = ["--quick", "--fp32-lm-head", "both", "--steps", "1", "--warmup", "1"]
    result = main([*argv, "--out-dir", str(tmp_path), "--work-dir", str(tmp_path)])
    [path] = tmp_path.glob("async_vs_sync-cpu-fp32-head-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["errors"] == []
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["fp32_head_job"]["generators"]["fp32_lm_head"] is True
    assert "fp32_lm_head" not in cfg["job"]["generators"]
    assert cfg["max_staleness"] == [0]  # on-policy by default: the arithmetic alone
    runs = m["runs"]["0"]
    assert runs.keys() == {"bf16_head", "fp32_head"}
    for run in runs.values():
        assert len(run["progress"]) == 2 and run["buffer"]["consumed"] == 2 * 4
        # every step's records carry both figures; the job's means are theirs
        lps = [p["logprob_diff_mean"] for p in run["progress"]]
        assert run["logprob_abs_diff_mean"] == pytest.approx(sum(lps) / 2) and run["kl_k3_mean"] is not None
        assert run["samples_per_s"] > 0
        assert run["trainer_fp32_lm_head"] == [False]  # a CPU trainer computes in fp32: nothing to change
    bf, fp = runs["bf16_head"], runs["fp32_head"]
    assert (
        r["fp32_vs_bf16_head_logprob_abs_diff"] == fp["logprob_abs_diff_mean"] / bf["logprob_abs_diff_mean"]
    )
    assert r["fp32_vs_bf16_head_kl_k3"] == fp["kl_k3_mean"] / bf["kl_k3_mean"]
    assert r["fp32_vs_bf16_head_samples_per_s"] == fp["samples_per_s"] / bf["samples_per_s"]
    assert m["samples_per_s_fp32_head_staleness_0"] == fp["samples_per_s"]
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("async_vs_sync fp32_vs_bf16_head_logprob_abs_diff=")
    )
